package deploy

import (
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// loopback reports whether a listen address accepts connections from this
// host only.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func TestLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:8081": true, "[::1]:8081": true, "localhost:8081": true,
		":8081": false, "0.0.0.0:8081": false, "10.0.0.5:8081": false, "8081": false,
	} {
		if got := loopback(addr); got != want {
			t.Errorf("loopback(%q) = %v, want %v", addr, got, want)
		}
	}
}

// TestExamplesAdminLoopback: the example configs run without an admin
// token (`make run`, the README), so their admin API (and data plane) must
// not be reachable from the network. When admin_listen is empty the admin
// API is served on listen.
func TestExamplesAdminLoopback(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(repoRoot, "examples", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no example configs: %v", err)
	}
	for _, f := range files {
		cfg, err := config.LoadConfig(f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		admin := cfg.AdminListen
		if admin == "" {
			admin = cfg.Listen
		}
		if !loopback(admin) || !loopback(cfg.Listen) {
			t.Errorf("%s: listen %q, admin_listen %q: an example without KVROUTER_ADMIN_TOKEN must bind loopback", f, cfg.Listen, cfg.AdminListen)
		}
		if cfg.GRPC.Listen != "" && !loopback(cfg.GRPC.Listen) {
			t.Errorf("%s: grpc.listen %q beyond loopback without a token", f, cfg.GRPC.Listen)
		}
	}
}

// TestComposeAdminGuarded: in compose the routers bind every interface of
// their containers, so the admin API always has a token, and its host port
// (like NATS's, which has no credentials) is published on loopback only.
func TestComposeAdminGuarded(t *testing.T) {
	cf := loadCompose(t)
	n := 0
	for _, name := range sortedKeys(cf.Services) {
		s := cf.Services[name]
		if binaryOf(s.Entrypoint) == "kvrouter" {
			n++
			if s.Environment["KVROUTER_ADMIN_TOKEN"] == "" {
				t.Errorf("service %s: no KVROUTER_ADMIN_TOKEN default: the admin API would be open", name)
			}
		}
		if binaryOf(s.Entrypoint) != "kvrouter" && name != "nats" {
			continue
		}
		for _, p := range s.Ports {
			parts := strings.Split(p, ":")
			container := parts[len(parts)-1]
			open := container == "8081" || name == "nats"
			if open && (len(parts) != 3 || !loopback(parts[0]+":"+parts[1])) {
				t.Errorf("service %s publishes %q on every host interface; want 127.0.0.1:HOST:CONTAINER", name, p)
			}
		}
	}
	if n == 0 {
		t.Fatal("no kvrouter service in compose.yaml")
	}
}
