package deploy

import (
	"go/scanner"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/template"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
)

// metricName matches the names this project exports: kvrouter_* (router,
// consumer, tiers), kvbridge_* (bridge) and vllm:* (the engine's names,
// which kvsim reproduces; dashboards read them from real engines too).
var metricName = regexp.MustCompile(`^(kvrouter_[a-z0-9_]+|kvbridge_[a-z0-9_]+|vllm:[a-z0-9_:]+)$`)

// codeMetrics is the set of metric names in the main module's non-test Go
// sources (string literals of the shape above).
type codeMetricSet struct {
	once  sync.Once
	err   error
	names map[string]bool
}

var codeMetrics codeMetricSet // lazily scanned; read-only after once.Do

func (c *codeMetricSet) get(t *testing.T) map[string]bool {
	t.Helper()
	c.once.Do(func() { c.names, c.err = scanMetricNames(repoRoot) })
	if c.err != nil {
		t.Fatalf("scanning metric names: %v", c.err)
	}
	return c.names
}

func scanMetricNames(root string) (map[string]bool, error) {
	names := map[string]bool{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			n := d.Name()
			if path != root && (n == "deploy" || n == "testdata" || n == "vendor" || strings.HasPrefix(n, ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		fset := token.NewFileSet()
		var s scanner.Scanner
		s.Init(fset.AddFile(path, -1, len(src)), src, nil, 0)
		for {
			_, tok, lit := s.Scan()
			if tok == token.EOF {
				break
			}
			if tok != token.STRING {
				continue
			}
			if v, err := strconv.Unquote(lit); err == nil && metricName.MatchString(v) {
				names[v] = true
			}
		}
		return nil
	})
	return names, err
}

// exported reports whether the series name is exported by the code,
// counting the _bucket/_sum/_count series of histograms.
func exported(names map[string]bool, series string) bool {
	if names[series] {
		return true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(series, suf); ok && names[base] {
			return true
		}
	}
	return false
}

// promqlMetrics parses expr and returns the metric names it selects.
func promqlMetrics(expr string) ([]string, error) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	var out []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == model.MetricNameLabel {
					name = m.Value
				}
			}
			out = append(out, name)
		}
		return nil
	})
	return out, nil
}

// checkPromQL parses expr and checks every metric it reads is exported.
func checkPromQL(t *testing.T, where, expr string) {
	t.Helper()
	names := codeMetrics.get(t)
	ms, err := promqlMetrics(expr)
	if err != nil {
		t.Errorf("%s: PromQL does not parse: %v\n%s", where, err, expr)
		return
	}
	if len(ms) == 0 {
		t.Errorf("%s: PromQL reads no metric: %s", where, expr)
	}
	for _, m := range ms {
		if !exported(names, m) {
			t.Errorf("%s: metric %q is not exported by the code (grep the Go sources): %s", where, m, expr)
		}
	}
	checkPromQLLabels(t, where, expr)
}

// alertTemplateFuncs stand in for Prometheus's template functions so that
// annotation templates can be parsed (not executed).
var alertTemplateFuncs = template.FuncMap{
	"humanize": fmtStub, "humanize1024": fmtStub, "humanizeDuration": fmtStub,
	"humanizePercentage": fmtStub, "humanizeTimestamp": fmtStub, "title": fmtStub, "toUpper": fmtStub, "toLower": fmtStub,
}

func fmtStub(v any) string { return "" }

// alertTemplateHeader is what Prometheus prepends to every annotation
// template before parsing it (rules/alerting.go), defining $labels and $value.
const alertTemplateHeader = "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$externalURL := .ExternalURL}}{{$value := .Value}}"

func TestMetricNamesScanned(t *testing.T) {
	names := codeMetrics.get(t)
	// A few names from each exporting package, so a broken scanner cannot
	// let every dashboard and alert check pass vacuously.
	for _, n := range []string{
		"kvrouter_requests_total", "kvrouter_overflows_total", "kvrouter_instance_healthy", // router/httpapi/metrics.go
		"kvrouter_kv_decisions_total",        // router/kvaware/kvaware_metrics.go
		"kvrouter_events_lag_seconds",        // events/consumer/metrics.go
		"kvbridge_gaps_total",                // events/bridge/metrics.go
		"kvrouter_tier_blocks_evicted_total", // tiers/tiermetrics/accounting.go
		"vllm:prefix_cache_hits_total",       // sim/simserver/metrics.go
	} {
		if !names[n] {
			t.Errorf("metric %s not found in the code scan (%d names found)", n, len(names))
		}
	}
	for _, tc := range []struct {
		series string
		want   bool
	}{
		{"kvrouter_events_lag_seconds_bucket", true},
		{"kvrouter_requests_total", true},
		{"kvrouter_no_such_metric", false},
		{"kvrouter_requests", false},
	} {
		if got := exported(names, tc.series); got != tc.want {
			t.Errorf("exported(%s) = %v, want %v", tc.series, got, tc.want)
		}
	}
}

func TestPromQLMetrics(t *testing.T) {
	for _, tc := range []struct {
		expr    string
		want    []string
		wantErr bool
	}{
		{expr: `sum by (pool) (rate(kvrouter_requests_total{status="200"}[5m]))`, want: []string{"kvrouter_requests_total"}},
		{expr: `a / on (pool) b`, want: []string{"a", "b"}},
		{expr: `{__name__="kvbridge_gaps_total"}`, want: []string{"kvbridge_gaps_total"}},
		{expr: `sum(rate(x[5m]`, wantErr: true},
	} {
		got, err := promqlMetrics(tc.expr)
		if (err != nil) != tc.wantErr {
			t.Errorf("%s: err %v, want error %v", tc.expr, err, tc.wantErr)
			continue
		}
		if strings.Join(got, ",") != strings.Join(tc.want, ",") {
			t.Errorf("%s: got %v, want %v", tc.expr, got, tc.want)
		}
	}
}

// TestAlerts checks the PrometheusRule: the alerts the operators need are
// there, every expression parses and reads only metrics the code exports,
// every duration parses, and every annotation template parses.
func TestAlerts(t *testing.T) {
	b := render(t, "kubernetes/base")
	pr, ok := b.rules["kvrouter"]
	if !ok {
		t.Fatal("no PrometheusRule kvrouter in the base")
	}
	seen := map[string]bool{}
	for _, g := range pr.Spec.Groups {
		if g.Name == "" || len(g.Rules) == 0 {
			t.Errorf("group %q: needs a name and rules", g.Name)
		}
		for _, r := range g.Rules {
			where := "alert " + r.Alert
			if r.Alert == "" {
				t.Errorf("group %s: recording rules are not expected here (record %q)", g.Name, r.Record)
				continue
			}
			if seen[r.Alert] {
				t.Errorf("%s: duplicate", where)
			}
			seen[r.Alert] = true
			checkPromQL(t, where, r.Expr.String())
			if r.For != nil {
				if _, err := model.ParseDuration(string(*r.For)); err != nil {
					t.Errorf("%s: for %q: %v", where, *r.For, err)
				}
			}
			switch r.Labels["severity"] {
			case "critical", "warning", "info":
			default:
				t.Errorf("%s: severity %q: want critical, warning or info", where, r.Labels["severity"])
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: needs summary and description annotations", where)
			}
			for k, v := range r.Annotations {
				if _, err := template.New(k).Funcs(alertTemplateFuncs).Parse(alertTemplateHeader + v); err != nil {
					t.Errorf("%s: annotation %s: %v", where, k, err)
				}
			}
		}
	}
	// The alerts docs/operations.md lists: event stream stale, index gaps,
	// overflow rate high, no healthy instances.
	for _, want := range []string{"KVRouterEventStreamStale", "KVRouterIndexGaps", "KVBridgeIndexGapCleared", "KVRouterOverflowRateHigh", "KVRouterNoHealthyInstances"} {
		if !seen[want] {
			t.Errorf("alert %s missing", want)
		}
	}
}
