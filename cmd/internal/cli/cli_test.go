package cli

import (
	"bytes"
	"strings"
	"testing"
)

func TestLogger(t *testing.T) {
	for _, tc := range []struct {
		level     string
		wantDebug bool
		wantInfo  bool
		wantErr   bool
	}{
		{"debug", true, true, false},
		{"info", false, true, false},
		{"WARN", false, false, false},
		{"info+2", false, false, false},
		{"loud", false, false, true},
		{"", false, false, true},
	} {
		t.Run(tc.level, func(t *testing.T) {
			var buf bytes.Buffer
			log, err := Logger(&buf, tc.level)
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), "--log-level") {
					t.Fatalf("err %v, want a --log-level error", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			log.Debug("d")
			log.Info("i")
			if got := strings.Contains(buf.String(), "msg=d"); got != tc.wantDebug {
				t.Errorf("debug line written %t, want %t", got, tc.wantDebug)
			}
			if got := strings.Contains(buf.String(), "msg=i"); got != tc.wantInfo {
				t.Errorf("info line written %t, want %t", got, tc.wantInfo)
			}
		})
	}
}
