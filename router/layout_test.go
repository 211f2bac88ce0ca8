package router_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestPackageLayout holds the dependency facts docs/architecture.md states
// for the router's packages, from `go list -deps`: the leaves import no
// other kvrouter package, and the KV-state pipeline knows nothing of the
// router it feeds.
func TestPackageLayout(t *testing.T) {
	const mod = "github.com/kvrouter/kvrouter/"
	// deps lists the packages pkg depends on outside the standard library.
	deps := func(pkg string) []string {
		out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", mod+pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		return strings.Fields(string(out))
	}
	tests := []struct {
		pkg    string
		forbid func(dep string) bool
		why    string
	}{
		{"config", func(d string) bool { return strings.HasPrefix(d, mod) && d != mod+"config" }, "config is a leaf"},
		{"config", func(d string) bool { return !strings.HasPrefix(d, mod) && d != "gopkg.in/yaml.v3" }, "config needs only the standard library and yaml.v3"},
		{"router/openai", func(d string) bool { return strings.HasPrefix(d, mod) && d != mod+"router/openai" }, "router/openai is a leaf"},
		{"router/openai", func(d string) bool { return !strings.HasPrefix(d, mod) }, "router/openai needs only the standard library"},
		{"router/kvstate", func(d string) bool {
			return d == mod+"router" || strings.HasPrefix(d, mod+"router/") && d != mod+"router/kvstate"
		}, "the KV-state pipeline knows nothing of the router it feeds"},
		{"router/kvstate", func(d string) bool { return d == mod+"grpcapi" }, "the KV-state pipeline knows nothing of the gRPC edge"},
	}
	for _, tc := range tests {
		for _, d := range deps(tc.pkg) {
			if tc.forbid(d) {
				t.Errorf("%s imports %s: %s", tc.pkg, d, tc.why)
			}
		}
	}
}
