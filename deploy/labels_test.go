package deploy

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	promparser "github.com/prometheus/prometheus/promql/parser"
)

// targetLabels are added by Prometheus and the prometheus-operator to every
// scraped series (ServiceMonitor and PodMonitor targets).
var targetLabels = []string{"namespace", "pod", "container", "service", "endpoint", "job", "instance"}

// codeLabelSet maps a metric name to the label names the code gives it
// (variable labels and const labels), read from the Go AST of the
// prometheus.New* calls. A metric whose definition cannot be read statically
// (a name passed through a helper's parameter) has no entry; its labels are
// then not checked.
type codeLabelSet struct {
	once   sync.Once
	err    error
	labels map[string]map[string]bool
}

var codeLabels codeLabelSet // lazily parsed; read-only after once.Do

func (c *codeLabelSet) get(t *testing.T) map[string]map[string]bool {
	t.Helper()
	c.once.Do(func() { c.labels, c.err = scanMetricLabels(repoRoot) })
	if c.err != nil {
		t.Fatalf("scanning metric labels: %v", c.err)
	}
	return c.labels
}

// moduleGoFiles lists the non-test Go files of the main module below root
// by directory, leaving out this module (deploy), testdata, vendor and
// hidden directories.
func moduleGoFiles(root string) (map[string][]string, error) {
	dirs := map[string][]string{}
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
		if strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			dirs[filepath.Dir(path)] = append(dirs[filepath.Dir(path)], path)
		}
		return nil
	})
	return dirs, err
}

// scanMetricLabels parses every non-test Go file of the main module,
// directory by directory (consts resolve within a package).
func scanMetricLabels(root string) (map[string]map[string]bool, error) {
	out := map[string]map[string]bool{}
	dirs, err := moduleGoFiles(root)
	if err != nil {
		return nil, err
	}
	for _, files := range dirs {
		fset := token.NewFileSet()
		var parsed []*ast.File
		consts := map[string]string{}
		for _, f := range files {
			af, err := parser.ParseFile(fset, f, nil, 0)
			if err != nil {
				return nil, err
			}
			parsed = append(parsed, af)
			for _, decl := range af.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if i < len(vs.Values) {
							if s, ok := stringLit(vs.Values[i]); ok {
								consts[n.Name] = s
							}
						}
					}
				}
			}
		}
		for _, af := range parsed {
			scanFileLabels(af, consts, out)
		}
	}
	return out, nil
}

func stringLit(e ast.Expr) (string, bool) {
	bl, ok := e.(*ast.BasicLit)
	if !ok || bl.Kind != token.STRING {
		return "", false
	}
	s, err := strconv.Unquote(bl.Value)
	return s, err == nil
}

// stringList returns the elements of a []string{...} literal.
func stringList(e ast.Expr) []string {
	cl, ok := e.(*ast.CompositeLit)
	if !ok {
		return nil
	}
	var out []string
	for _, el := range cl.Elts {
		if s, ok := stringLit(el); ok {
			out = append(out, s)
		}
	}
	return out
}

// labelKeys returns the keys of a prometheus.Labels{...} literal.
func labelKeys(e ast.Expr) []string {
	cl, ok := e.(*ast.CompositeLit)
	if !ok {
		return nil
	}
	var out []string
	for _, el := range cl.Elts {
		if kv, ok := el.(*ast.KeyValueExpr); ok {
			if s, ok := stringLit(kv.Key); ok {
				out = append(out, s)
			}
		}
	}
	return out
}

func scanFileLabels(af *ast.File, consts map[string]string, out map[string]map[string]bool) {
	// Const labels given through a variable (cl := prometheus.Labels{...})
	// are taken from every Labels literal in the file.
	var fileConst []string
	ast.Inspect(af, func(n ast.Node) bool {
		if cl, ok := n.(*ast.CompositeLit); ok {
			if se, ok := cl.Type.(*ast.SelectorExpr); ok && se.Sel.Name == "Labels" {
				fileConst = append(fileConst, labelKeys(cl)...)
			}
		}
		return true
	})
	// Const labels of internal/metricset Sets built in the file
	// (metricset.Set{ConstLabels: ...}): every metric the Set declares
	// carries them.
	var setConst []string
	ast.Inspect(af, func(n ast.Node) bool {
		cl, ok := n.(*ast.CompositeLit)
		if !ok {
			return true
		}
		if se, ok := cl.Type.(*ast.SelectorExpr); !ok || se.Sel.Name != "Set" {
			return true
		}
		for _, el := range cl.Elts {
			if kv, ok := el.(*ast.KeyValueExpr); ok {
				if key, _ := kv.Key.(*ast.Ident); key != nil && key.Name == "ConstLabels" {
					if _, isLit := kv.Value.(*ast.CompositeLit); isLit {
						setConst = append(setConst, labelKeys(kv.Value)...)
					} else {
						setConst = append(setConst, fileConst...)
					}
				}
			}
		}
		return true
	})
	resolve := func(e ast.Expr) (string, bool) {
		if s, ok := stringLit(e); ok {
			return s, true
		}
		if id, ok := e.(*ast.Ident); ok {
			s, ok := consts[id.Name]
			return s, ok
		}
		return "", false
	}
	add := func(name string, lbls []string) {
		if !metricName.MatchString(name) {
			return
		}
		if out[name] == nil {
			out[name] = map[string]bool{}
		}
		for _, l := range lbls {
			out[name][l] = true
		}
	}
	ast.Inspect(af, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		se, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if x, ok := se.X.(*ast.Ident); ok && x.Name != "prometheus" {
			// A metricset.Set method: (name, help[, buckets], labels...).
			first := map[string]int{"Counter": -1, "Gauge": -1, "Histogram": -1, "CounterVec": 2, "GaugeVec": 2, "HistogramVec": 3}
			at, isSet := first[se.Sel.Name]
			if !isSet || len(call.Args) < 2 {
				return true
			}
			name, ok := resolve(call.Args[0])
			if !ok {
				return true
			}
			lbls := append([]string(nil), setConst...)
			if at > 0 {
				for _, a := range call.Args[min(at, len(call.Args)):] {
					if l, ok := stringLit(a); ok {
						lbls = append(lbls, l)
					} else {
						lbls = append(lbls, stringList(a)...)
					}
				}
			}
			add(name, lbls)
			return true
		}
		if x, ok := se.X.(*ast.Ident); !ok || x.Name != "prometheus" {
			return true
		}
		fn := se.Sel.Name
		if fn == "NewDesc" && len(call.Args) >= 3 {
			if name, ok := resolve(call.Args[0]); ok {
				lbls := stringList(call.Args[2])
				if len(call.Args) >= 4 {
					lbls = append(lbls, labelKeys(call.Args[3])...)
				}
				add(name, lbls)
			}
			return true
		}
		if !strings.HasPrefix(fn, "New") || len(call.Args) == 0 {
			return true
		}
		opts, ok := call.Args[0].(*ast.CompositeLit)
		if !ok {
			return true
		}
		var name string
		var lbls []string
		for _, el := range opts.Elts {
			kv, ok := el.(*ast.KeyValueExpr)
			if !ok {
				continue
			}
			key, _ := kv.Key.(*ast.Ident)
			switch {
			case key == nil:
			case key.Name == "Name":
				name, _ = resolve(kv.Value)
			case key.Name == "ConstLabels":
				if _, isLit := kv.Value.(*ast.CompositeLit); isLit {
					lbls = append(lbls, labelKeys(kv.Value)...)
				} else {
					lbls = append(lbls, fileConst...)
				}
			}
		}
		if name == "" {
			return true
		}
		if strings.HasSuffix(fn, "Vec") && len(call.Args) >= 2 {
			lbls = append(lbls, stringList(call.Args[1])...)
		}
		add(name, lbls)
		return true
	})
}

// checkPromQLLabels checks that the labels an expression matches on or
// groups by exist: a matcher's label on the series it selects; a grouping
// (by, on, ignoring, group_left/right) label on some series inside it. A
// label that does not exist silently matches nothing or groups everything
// into one series, so a dashboard shows nonsense rather than an error.
func checkPromQLLabels(t *testing.T, where, expr string) {
	t.Helper()
	for _, p := range promQLLabelProblems(codeLabels.get(t), expr) {
		t.Errorf("%s: %s: %s", where, p, expr)
	}
}

// promQLLabelProblems returns what checkPromQLLabels reports.
func promQLLabelProblems(known map[string]map[string]bool, expr string) []string {
	var problems []string
	e, err := promparser.NewParser(promparser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil // reported by checkPromQL
	}
	labelsOf := func(series string) (map[string]bool, bool) {
		base := series
		hist := false
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(series, suf); ok && known[b] != nil {
				base, hist = b, suf == "_bucket"
			}
		}
		ls, ok := known[base]
		if !ok {
			return nil, false
		}
		all := map[string]bool{}
		for l := range ls {
			all[l] = true
		}
		for _, l := range targetLabels {
			all[l] = true
		}
		if hist {
			all["le"] = true
		}
		return all, true
	}
	// under collects the label sets of every selector below n; ok is false
	// when one of them is unknown.
	under := func(n promparser.Node) (map[string]bool, bool) {
		all := map[string]bool{}
		okAll := true
		promparser.Inspect(n, func(c promparser.Node, _ []promparser.Node) error {
			if vs, ok := c.(*promparser.VectorSelector); ok {
				ls, ok := labelsOf(vs.Name)
				if !ok {
					okAll = false
					return nil
				}
				for l := range ls {
					all[l] = true
				}
			}
			return nil
		})
		return all, okAll
	}
	promparser.Inspect(e, func(n promparser.Node, _ []promparser.Node) error {
		switch x := n.(type) {
		case *promparser.VectorSelector:
			ls, ok := labelsOf(x.Name)
			if !ok {
				return nil
			}
			for _, m := range x.LabelMatchers {
				if m.Name != "__name__" && !ls[m.Name] {
					problems = append(problems, fmt.Sprintf("%s has no label %q (has %s)", x.Name, m.Name, keys(ls)))
				}
			}
		case *promparser.AggregateExpr:
			if ls, ok := under(x.Expr); ok {
				for _, g := range x.Grouping {
					if !ls[g] {
						problems = append(problems, fmt.Sprintf("grouping label %q exists on no series below %s", g, x.Op))
					}
				}
			}
		case *promparser.BinaryExpr:
			if x.VectorMatching == nil {
				return nil
			}
			lhs, okL := under(x.LHS)
			rhs, okR := under(x.RHS)
			if !okL || !okR {
				return nil
			}
			for _, g := range slicesConcat(x.VectorMatching.MatchingLabels, x.VectorMatching.Include) {
				if !lhs[g] && !rhs[g] {
					problems = append(problems, fmt.Sprintf("matching label %q exists on neither side", g))
				}
			}
		}
		return nil
	})
	return problems
}

func slicesConcat(a, b []string) []string { return append(append([]string(nil), a...), b...) }

func keys(m map[string]bool) string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return strings.Join(ks, ",")
}

func TestMetricLabelsScanned(t *testing.T) {
	known := codeLabels.get(t)
	for _, tc := range []struct {
		metric string
		labels []string
	}{
		{"kvrouter_requests_total", []string{"pool", "instance", "strategy", "reason", "status"}}, // Vec labels
		{"kvrouter_instance_healthy", []string{"pool", "instance"}},                               // NewDesc
		{"kvrouter_events_lag_seconds", []string{"pool"}},                                         // ConstLabels through a variable
		{"kvrouter_tier_blocks_evicted_total", []string{"instance", "tier"}},                      // Name from a const
		{"kvbridge_publish_retries_total", nil},                                                   // no labels
		{"vllm:time_to_first_token_seconds", []string{"model_name", "engine"}},
	} {
		got, ok := known[tc.metric]
		if !ok {
			t.Errorf("%s: labels not found", tc.metric)
			continue
		}
		want := map[string]bool{}
		for _, l := range tc.labels {
			want[l] = true
		}
		if keys(got) != keys(want) {
			t.Errorf("%s: labels %s, want %s", tc.metric, keys(got), keys(want))
		}
	}
}

func TestPromQLLabelCheck(t *testing.T) {
	for _, tc := range []struct {
		expr string
		ok   bool
	}{
		{`sum by (pool, reason) (rate(kvrouter_requests_total{status="200"}[5m]))`, true},
		{`sum by (namespace, pod) (kvbridge_table_blocks)`, true}, // target labels
		{`histogram_quantile(0.9, sum by (le) (rate(kvrouter_decision_seconds_bucket[5m])))`, true},
		{`sum by (pool) (rate(kvbridge_gaps_total[5m]))`, false},                           // bridge series have no pool
		{`rate(kvrouter_overflows_total{instance="a",tier="gpu"}[5m])`, false},             // no tier label
		{`a_unknown / on (pool) kvrouter_requests_total`, true},                            // unknown side: not checked
		{`kvrouter_kv_prompt_tokens_total / on (tier) kvrouter_kv_decisions_total`, false}, // neither has tier
	} {
		problems := promQLLabelProblems(codeLabels.get(t), tc.expr)
		if got := len(problems) == 0; got != tc.ok {
			t.Errorf("%s: problems %v, want ok=%v", tc.expr, problems, tc.ok)
		}
	}
}
