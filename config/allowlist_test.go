package config

import (
	"strings"
	"testing"
)

func TestURLAllowList(t *testing.T) {
	a, err := ParseAllowList([]string{"10.0.0.0/8", "192.168.1.7", "fd00::/8", "http://*.vllm.svc.cluster.local:8000", "https://engine-?.example.com"})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		url  string
		want bool
	}{
		{"http://10.1.2.3:8000", true},
		{"https://10.255.0.1", true},
		{"http://11.0.0.1:8000", false},
		{"http://192.168.1.7:8000/v1", true},
		{"http://192.168.1.8:8000", false},
		{"http://[fd00::1]:8000", true},
		{"http://[::ffff:10.0.0.5]:8000", true}, // IPv4-mapped is the IPv4 address
		{"http://[fe80::1]:8000", false},
		{"http://a.vllm.svc.cluster.local:8000", true},
		{"http://A.VLLM.svc.cluster.local:8000", true},
		{"http://a.vllm.svc.cluster.local:9000", false},
		{"http://a.vllm.svc.cluster.local", false}, // port 80
		{"https://a.vllm.svc.cluster.local:8000", false},
		{"https://engine-3.example.com:443", true},
		{"https://engine-3.example.com", true},
		{"https://engine-33.example.com", false},
		{"http://engine-3.example.com", false},
		{"http://evil.example.com@10.0.0.1:8000", true}, // userinfo is not the host
		{"http://10.0.0.1.evil.com:8000", false},
		{"not a url", false},
		{"http://", false},
	}
	for _, tc := range tests {
		if got := a.Allows(tc.url); got != tc.want {
			t.Errorf("allows(%q) = %v, want %v", tc.url, got, tc.want)
		}
	}
	if empty, _ := ParseAllowList(nil); !empty.Allows("http://anything:1") {
		t.Error("an empty list refuses")
	}
	for _, bad := range []string{"10.0.0.0/33", "example.com", "ftp://x:21", "http://:80", "http://[::1", "http://a[.com", "fe80::1%eth0"} {
		if _, err := ParseAllowList([]string{bad}); err == nil {
			t.Errorf("ParseAllowList(%q) accepted", bad)
		}
	}
}

// FuzzURLAllowList: parsing and matching never panic, and a list that
// parses allows every URL whose IP host is inside one of its networks.
func FuzzURLAllowList(f *testing.F) {
	f.Add("10.0.0.0/8", "http://10.1.2.3:8000")
	f.Add("http://*.svc:80", "http://a.svc")
	f.Add("::1", "http://[::1]:1")
	f.Fuzz(func(t *testing.T, entry, raw string) {
		a, err := ParseAllowList(strings.Split(entry, ","))
		if err != nil {
			return
		}
		_ = a.Allows(raw)
		for _, n := range a.nets {
			u := "http://" + n.Addr().String() + ":1"
			if n.Addr().Is6() {
				u = "http://[" + n.Addr().String() + "]:1"
			}
			if !a.Allows(u) {
				t.Fatalf("%q does not allow %q, its own network's address", entry, u)
			}
		}
	})
}
