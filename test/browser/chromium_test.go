package browser

import "testing"

func TestParseActivePort(t *testing.T) {
	tests := []struct {
		in       string
		port     int
		path     string
		wantFail bool
	}{
		{"9222\n/devtools/browser/abc\n", 9222, "/devtools/browser/abc", false},
		{"41234", 41234, "", false},
		{" 80 \r\n/x", 80, "/x", false},
		{"", 0, "", true},
		{"port\n/x", 0, "", true},
		{"0\n/x", 0, "", true},
		{"70000\n/x", 0, "", true},
		{"-1", 0, "", true},
	}
	for _, tc := range tests {
		port, path, err := ParseActivePort([]byte(tc.in))
		if (err != nil) != tc.wantFail || port != tc.port || path != tc.path {
			t.Errorf("ParseActivePort(%q) = %d, %q, %v; want %d, %q, fail %v", tc.in, port, path, err, tc.port, tc.path, tc.wantFail)
		}
	}
}

func FuzzParseActivePort(f *testing.F) {
	f.Add([]byte("9222\n/devtools/browser/abc\n"))
	f.Add([]byte(""))
	f.Add([]byte("\n\n\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		port, _, err := ParseActivePort(data)
		if err == nil && (port <= 0 || port > 65535) {
			t.Fatalf("accepted port %d from %q", port, data)
		}
	})
}
