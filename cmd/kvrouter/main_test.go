package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFlagsOverrideFileAndEnvSetsSecrets(t *testing.T) {
	path := filepath.Join(t.TempDir(), "r.yaml")
	doc := `
listen: ":9000"
max_body_bytes: 2048
index: {backend: redis, redis: {addrs: ["127.0.0.1:6379"]}}
pools:
  - name: a
    model: m1
    routing: {strategy: random, prefix_length: 2048}
    instances: [{id: x, url: "http://127.0.0.1:1"}]
  - name: b
    model: m2
    instances: [{id: y, url: "http://127.0.0.1:2"}]
`
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"KVROUTER_ADMIN_TOKEN": "tok", "KVROUTER_REDIS_PASSWORD": "pw"}
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, f flags)
	}{
		{"file only", nil, nil},
		{"flags win", []string{"--listen", "127.0.0.1:7000", "--max-body-bytes", "4096", "--strategy", "least_outstanding", "--concurrency-threshold", "9"}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := parseFlags(append([]string{"--config", path}, tc.args...), io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := loadConfig(f, func(k string) string { return env[k] })
			if err != nil {
				t.Fatal(err)
			}
			if cfg.AdminToken != "tok" || cfg.Index.Redis.Password != "pw" {
				t.Fatalf("secrets not taken from the environment: %q %q", cfg.AdminToken, cfg.Index.Redis.Password)
			}
			if tc.args == nil {
				if cfg.Listen != ":9000" || cfg.MaxBodyBytes != 2048 || cfg.Pools[0].Routing.Strategy != "random" || cfg.Pools[1].Routing.Strategy != "prefix_aware" {
					t.Fatalf("file values: %+v", cfg)
				}
				return
			}
			if cfg.Listen != "127.0.0.1:7000" || cfg.MaxBodyBytes != 4096 {
				t.Fatalf("flags did not override: %+v", cfg)
			}
			for _, p := range cfg.Pools {
				if p.Routing.Strategy != "least_outstanding" || p.Routing.ConcurrencyThreshold != 9 {
					t.Fatalf("pool %s routing %+v", p.Name, p.Routing)
				}
			}
			if cfg.Pools[0].Routing.PrefixLength != 2048 || cfg.Pools[1].Routing.PrefixLength != 8192 {
				t.Fatal("a flag not given changed prefix_length")
			}
		})
	}
}

func TestFlagErrors(t *testing.T) {
	for _, args := range [][]string{{}, {"--config", "x", "extra"}, {"--nope"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	f, _ := parseFlags([]string{"--config", "/nonexistent.yaml"}, io.Discard)
	if _, err := loadConfig(f, func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), "nonexistent") {
		t.Errorf("missing file: %v", err)
	}
}
