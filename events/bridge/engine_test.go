package bridge

import (
	"strings"
	"testing"
)

func TestParseStartTime(t *testing.T) {
	tests := []struct {
		name string
		page string
		want float64
		ok   bool
	}{
		{"prometheus client", "# HELP process_start_time_seconds Start time.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.76473e+09\n", 1.76473e9, true},
		{"among others", "vllm:num_requests_running{engine=\"0\"} 3\nprocess_start_time_seconds\t1764730000.25\nprocess_cpu_seconds_total 9\n", 1764730000.25, true},
		{"prefix of another name", "process_start_time_seconds_total 5\n", 0, false},
		{"labels", "process_start_time_seconds{pid=\"1\"} 5\n", 0, false},
		{"garbage value", "process_start_time_seconds abc\n", 0, false},
		{"nan", "process_start_time_seconds NaN\n", 0, false},
		{"negative", "process_start_time_seconds -1\n", 0, false},
		{"none", "up 1\n", 0, false},
		{"empty", "", 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseStartTime(strings.NewReader(tc.page))
			if got != tc.want || ok != tc.ok {
				t.Fatalf("got %v, %v; want %v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

func FuzzParseStartTime(f *testing.F) {
	f.Add("process_start_time_seconds 1.7e+09\n")
	f.Add("# TYPE x gauge\nprocess_start_time_seconds\t12 1700000000000\n")
	f.Add("process_start_time_seconds")
	f.Fuzz(func(t *testing.T, page string) {
		v, ok := parseStartTime(strings.NewReader(page))
		if ok != (v > 0) || v > 1e11 {
			t.Fatalf("parseStartTime(%q) = %v, %v", page, v, ok)
		}
	})
}
