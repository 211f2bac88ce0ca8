package archtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

const module = "github.com/kvrouter/kvrouter"

// Dependency families named by the rules below (import path prefixes).
var (
	natsPkgs       = []string{"github.com/nats-io"}
	zmqPkgs        = []string{"github.com/go-zeromq"}
	httpServerPkgs = []string{"net/http"} // the server lives in net/http itself
	redisPkgs      = []string{"github.com/redis"}
	promPkgs       = []string{"github.com/prometheus"}
	otelPkgs       = []string{"go.opentelemetry.io"}
)

// rule is one fact of docs/architecture.md ("Dependency facts"): pkg (a path
// inside the module) depends, directly or not, on nothing outside the
// standard library but allow (stdOnly), and on nothing under forbid.
type rule struct {
	pkg     string
	stdOnly bool
	allow   []string // with stdOnly: non-standard prefixes still allowed
	forbid  [][]string
	why     string
}

// rules is the table to extend: one line per fact.
var rules = []rule{
	{pkg: "events", stdOnly: true, why: "the codec is what the index and the simulator share; it must not bring a transport"},
	{pkg: "spechold", stdOnly: true, allow: []string{module + "/internal/fmix"}, why: "speculative holds are a data structure shared by the router and replica sync; they need no index backend or transport (internal/fmix: the hash mixer of its table)"},
	{pkg: "tiers", stdOnly: true, why: "a leaf table; its Prometheus accounting is tiers/tiermetrics"},
	{pkg: "kvindex", forbid: [][]string{natsPkgs, zmqPkgs, httpServerPkgs}, why: "the index knows events, not how they travel or who asks"},
	{pkg: "sim", forbid: [][]string{natsPkgs, zmqPkgs, httpServerPkgs, redisPkgs}, why: "the engine model is shared by kvsim and kvbench's discrete-event mode; sockets are sim/simserver's"},
	{pkg: "events/enginezmq", forbid: [][]string{natsPkgs, promPkgs}, why: "the engine's ZMQ side knows nothing of NATS"},
	{pkg: "events/kvstream", forbid: [][]string{zmqPkgs, redisPkgs}, why: "the NATS side knows nothing of the engine's sockets"},
	{pkg: "config", stdOnly: true, allow: []string{"gopkg.in/yaml.v3", module + "/internal/zero"}, why: "a leaf: the whole binary's configuration, read by every component"},
	{pkg: "router/openai", stdOnly: true, why: "a leaf: the OpenAI side of a request, shared by every edge"},
	{pkg: "router", forbid: [][]string{natsPkgs, redisPkgs, zmqPkgs, promPkgs, otelPkgs, {module + "/kvindex"}, {module + "/events"}}, why: "the core: it reaches exact-routing state through router.Exact (router/kvaware), traces through the router.Spans hook and serves nothing; the HTTP data plane's metrics and spans are router/httpapi's"},
	{pkg: "router/admin/adminapi", stdOnly: true, why: "the admin API's wire types, decoded by kvctl without linking the router"},
	{pkg: "router/tlscert", stdOnly: true, allow: []string{module + "/config", module + "/internal/zero", "gopkg.in/yaml.v3"}, why: "the listeners' certificates: crypto/tls over the config's tls: section, shared by the HTTP and gRPC listeners"},
	{pkg: "router/kvstate", forbid: [][]string{{module + "/router"}, {module + "/grpcapi"}}, why: "the KV-state pipeline reports discoveries; it knows nothing of the router it feeds"},
}

func init() {
	for _, b := range []string{"kvrouter", "kvbridge", "kvsim", "kvbench", "kvctl"} {
		rules = append(rules, rule{pkg: "cmd/" + b, forbid: [][]string{{"testing"}},
			why: "a shipped binary links no test framework (shared benchmark helpers such as internal/cputime take interfaces, not *testing.B)"})
	}
}

// listed is what `go list -deps -json` says of one package.
type listed struct {
	ImportPath string
	Standard   bool
	Deps       []string
	Error      *struct{ Err string }
}

// goList runs the toolchain that runs this test on the given packages and
// returns every package of their dependency closure by import path.
func goList(t *testing.T, pkgs []string) map[string]listed {
	t.Helper()
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if runtime.GOOS == "windows" {
		gobin += ".exe"
	}
	args := append([]string{"list", "-deps", "-json=ImportPath,Standard,Deps,Error"}, pkgs...)
	cmd := exec.Command(gobin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	all := map[string]listed{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p listed
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		if p.Error != nil {
			t.Fatalf("go list %s: %s", p.ImportPath, p.Error.Err)
		}
		all[p.ImportPath] = p
	}
	return all
}

// under reports whether path is prefix or inside it.
func under(path string, prefixes []string) bool {
	for _, p := range prefixes {
		if path == p || strings.HasPrefix(path, p+"/") {
			return true
		}
	}
	return false
}

// violations lists what r says pkg may not depend on, given its closure.
func violations(r rule, root listed, all map[string]listed) []string {
	var bad []string
	for _, d := range root.Deps {
		switch {
		case r.stdOnly && !all[d].Standard && !under(d, r.allow):
			bad = append(bad, d+" (not standard library)")
		default:
			for _, f := range r.forbid {
				if under(d, f) {
					bad = append(bad, d)
					break
				}
			}
		}
	}
	return bad
}

func TestDependencyFacts(t *testing.T) {
	pkgs := make([]string, len(rules))
	for i, r := range rules {
		pkgs[i] = module + "/" + r.pkg
	}
	all := goList(t, pkgs)
	for _, r := range rules {
		t.Run(r.pkg, func(t *testing.T) {
			root, ok := all[module+"/"+r.pkg]
			if !ok {
				t.Fatalf("go list did not report %s", r.pkg)
			}
			if len(root.Deps) == 0 {
				t.Fatalf("%s: no dependencies listed; the check would pass vacuously", r.pkg)
			}
			if bad := violations(r, root, all); len(bad) > 0 {
				t.Errorf("%s depends on %s\n(%s; docs/architecture.md, Dependency facts)", r.pkg, strings.Join(bad, ", "), r.why)
			}
			t.Logf("%s: %d packages in its dependency closure", r.pkg, len(root.Deps))
		})
	}
}

// TestRulesCatchViolations holds the checker itself to account: on the
// module's real dependency graph, rules that must fail do.
func TestRulesCatchViolations(t *testing.T) {
	all := goList(t, []string{module + "/events/kvstream", module + "/events/enginezmq", module + "/kvindex", module + "/router/httpapi", module + "/internal/testenv"})
	cases := []struct {
		r    rule
		want string // a dependency the rule must report
	}{
		{rule{pkg: "events/kvstream", forbid: [][]string{natsPkgs}}, "github.com/nats-io/nats.go"},
		{rule{pkg: "events/kvstream", forbid: [][]string{httpServerPkgs}}, "net/http"},
		{rule{pkg: "events/enginezmq", stdOnly: true}, "github.com/go-zeromq/zmq4"},
		{rule{pkg: "kvindex", forbid: [][]string{redisPkgs}}, "github.com/redis/go-redis/v9"},
		// The core's rule, on the data plane that does import them.
		{rule{pkg: "router/httpapi", forbid: [][]string{promPkgs}}, "github.com/prometheus/client_golang"},
		{rule{pkg: "router/httpapi", forbid: [][]string{otelPkgs}}, "go.opentelemetry.io/otel"},
		// The binaries' rule, on the test helpers that do link testing.
		{rule{pkg: "internal/testenv", forbid: [][]string{{"testing"}}}, "testing"},
		{rule{pkg: "kvindex", stdOnly: true, allow: []string{"github.com/cespare", "github.com/redis", "go.uber.org", "golang.org/x/sys"}}, module + "/events"},
	}
	for _, c := range cases {
		bad := violations(c.r, all[module+"/"+c.r.pkg], all)
		found := false
		for _, b := range bad {
			found = found || strings.HasPrefix(b, c.want)
		}
		if !found {
			t.Errorf("rule on %s did not report %s; reported %v", c.r.pkg, c.want, bad)
		}
	}
}
