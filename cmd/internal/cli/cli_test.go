package cli

import (
	"bytes"
	"errors"
	"flag"
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

// --help prints the head, the flags, then the foot.
func TestSetUsage(t *testing.T) {
	var buf bytes.Buffer
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.SetOutput(&buf) // where PrintDefaults writes: each binary sets it to the same writer
	fs.Int("n", 3, "how many")
	SetUsage(fs, &buf, "usage: x [flags]\n", "see docs\n")
	if err := fs.Parse([]string{"--help"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("parse --help: %v", err)
	}
	want := "usage: x [flags]\n  -n int\n    \thow many (default 3)\nsee docs\n"
	if buf.String() != want {
		t.Fatalf("help %q, want %q", buf.String(), want)
	}
}
