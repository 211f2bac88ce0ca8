package deploy

import (
	"log"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"helm.sh/helm/v4/pkg/chart/common"
	chartutil "helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/loader"
	chartv2 "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/lint"
	"helm.sh/helm/v4/pkg/chart/v2/lint/support"
	v2util "helm.sh/helm/v4/pkg/chart/v2/util"
	"helm.sh/helm/v4/pkg/engine"
	"sigs.k8s.io/yaml"
)

const chartDir = "helm/kvrouter"

// chartReleases are the value sets the chart is rendered with, and what
// each must provide (the same expectations as the kustomize overlays).
var chartReleases = []struct {
	values []string // -f files, in order
	ov     overlay
}{
	{nil, overlay{dir: chartDir, namespace: "kvrouter", minRouters: 2, natsNodes: 1, engine: "vllm",
		externalSecrets: []string{"kvrouter-admin"}}},
	{[]string{"values-production.yaml"}, overlay{dir: chartDir, namespace: "kvrouter", minRouters: 3, natsNodes: 3, engine: "vllm", replicaSync: true,
		redis: true, externalSecrets: []string{"kvrouter-admin", "kvrouter-redis"}, production: true, monitoring: true}},
}

// quietHelm keeps Helm's informational logs (it logs every followed
// symlink: files/prometheusrule.yaml) out of the test output while t runs;
// warnings still show. The deploy tests do not run in parallel.
func quietHelm(t *testing.T) {
	prev, out, flags := slog.Default(), log.Writer(), log.Flags()
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	t.Cleanup(func() {
		// SetDefault pointed the log package at the handler; undo that too.
		slog.SetDefault(prev)
		log.SetOutput(out)
		log.SetFlags(flags)
	})
}

// loadChart loads the chart directory as `helm template` does.
func loadChart(t *testing.T) *chartv2.Chart {
	t.Helper()
	quietHelm(t)
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load %s: %v", chartDir, err)
	}
	ch, ok := c.(*chartv2.Chart)
	if !ok {
		t.Fatalf("%s: %T, want an apiVersion v2 chart", chartDir, c)
	}
	return ch
}

// mergeValues merges src over dst the way `helm -f a.yaml -f b.yaml` does:
// maps merge key by key, anything else is replaced.
func mergeValues(dst, src map[string]any) map[string]any {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				dst[k] = mergeValues(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
	return dst
}

// chartValues reads and merges the chart's value files, in order.
func chartValues(t *testing.T, valueFiles ...string) map[string]any {
	t.Helper()
	vals := map[string]any{}
	for _, f := range valueFiles {
		raw, err := os.ReadFile(filepath.Join(chartDir, f))
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := yaml.UnmarshalStrict(raw, &m); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		vals = mergeValues(vals, m)
	}
	return vals
}

// renderChartValues renders the chart with Helm's own engine after
// validating the values against values.schema.json, as `helm template`
// does, and returns the rendered files by name. The engine is strict: a
// template reading a value that does not exist (a typo in a template)
// fails instead of rendering an empty string.
func renderChartValues(t *testing.T, ch *chartv2.Chart, namespace string, vals map[string]any) (map[string]string, error) {
	t.Helper()
	rv, err := chartutil.ToRenderValuesWithSchemaValidation(ch, vals,
		common.ReleaseOptions{Name: "kvrouter", Namespace: namespace, IsInstall: true, Revision: 1}, nil, false)
	if err != nil {
		return nil, err
	}
	return engine.Engine{Strict: true}.Render(ch, rv)
}

// renderChart renders the chart with the value files and decodes every
// object strictly into its API type, like render does for kustomize.
func renderChart(t *testing.T, namespace string, valueFiles ...string) *bundle {
	t.Helper()
	ch := loadChart(t)
	files, err := renderChartValues(t, ch, namespace, chartValues(t, valueFiles...))
	if err != nil {
		t.Fatalf("helm template %s %v: %v", chartDir, valueFiles, err)
	}
	if notes := files[ch.Name()+"/templates/NOTES.txt"]; !strings.Contains(notes, "kvctl instances --router=http://127.0.0.1:") {
		t.Errorf("NOTES.txt rendered as %q", notes)
	}
	b := bundleOf(t, files)
	if len(b.objects) == 0 {
		t.Fatalf("%s %v rendered no objects", chartDir, valueFiles)
	}
	return b
}

// bundleOf decodes the rendered templates' objects strictly, in file order.
func bundleOf(t *testing.T, files map[string]string) *bundle {
	t.Helper()
	b := newBundle(chartDir)
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if !strings.HasSuffix(n, ".yaml") || strings.HasPrefix(filepath.Base(n), "_") {
			continue
		}
		for _, doc := range splitYAMLDocs(files[n]) {
			var meta struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
				Metadata   struct {
					Name      string `json:"name"`
					Namespace string `json:"namespace"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				t.Errorf("%s: %v\n%s", n, err, doc)
				continue
			}
			om := objectMeta{apiVersion: meta.APIVersion, kind: meta.Kind, name: meta.Metadata.Name, namespace: meta.Metadata.Namespace}
			if err := b.add(om, []byte(doc)); err != nil {
				t.Errorf("%s: %v\n%s", n, err, doc)
			}
		}
	}
	return b
}

var docSeparator = regexp.MustCompile(`(?m)^---\s*$`)

// splitYAMLDocs splits a rendered template into its non-empty documents.
func splitYAMLDocs(s string) []string {
	var out []string
	for _, d := range docSeparator.Split(s, -1) {
		empty := true
		for _, l := range strings.Split(d, "\n") {
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				empty = false
				break
			}
		}
		if !empty {
			out = append(out, d)
		}
	}
	return out
}

// TestHelmChart renders the chart with the default and the production
// values and runs on each every check the kustomize overlays pass: strict
// decoding into the API types, selectors, ports, probes, Secrets, flags
// and environment against the real binaries, router.yaml through the
// router's validation and --check-config, the engines' vLLM flags and
// sidecars, NATS's config through nats-server's parser, Redis's ACL.
func TestHelmChart(t *testing.T) {
	for _, rel := range chartReleases {
		name := "default"
		if len(rel.values) > 0 {
			name = strings.Join(rel.values, "+")
		}
		t.Run(name, func(t *testing.T) {
			b := renderChart(t, rel.ov.namespace, rel.values...)
			if len(b.namespaces) > 0 {
				t.Error("the chart must not create its namespace (helm install -n NS --create-namespace does)")
			}
			checkBundle(t, b, rel.ov)
		})
	}
}

// TestHelmLint runs Helm's own linter (`helm lint --strict`: warnings
// fail too) with each value set, for the oldest Kubernetes the chart
// supports.
func TestHelmLint(t *testing.T) {
	kv, err := common.ParseKubeVersion("v1.30.0")
	if err != nil {
		t.Fatal(err)
	}
	quietHelm(t)
	for _, rel := range chartReleases {
		l := lint.RunAll(chartDir, chartValues(t, rel.values...), rel.ov.namespace, lint.WithKubeVersion(kv))
		for _, m := range l.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("values %v: %s", rel.values, m)
			}
		}
	}
}

// TestHelmChartMetadata: the chart supports the Kubernetes versions its
// manifests need, and its default image is the one the kustomize
// production overlay pins and `make image` builds.
func TestHelmChartMetadata(t *testing.T) {
	ch := loadChart(t)
	if err := ch.Validate(); err != nil {
		t.Errorf("Chart.yaml: %v", err)
	}
	if !v2util.IsCompatibleRange(ch.Metadata.KubeVersion, "v1.30.0") || v2util.IsCompatibleRange(ch.Metadata.KubeVersion, "v1.29.9") {
		t.Errorf("kubeVersion %q: want >= 1.30 (preStop sleep)", ch.Metadata.KubeVersion)
	}
	if ch.Schema == nil {
		t.Error("the chart has no values.schema.json")
	}
	b := render(t, "kubernetes/overlays/production")
	d := b.deployments["kvrouter"]
	if d == nil {
		t.Fatal("production overlay: no Deployment kvrouter")
	}
	img := d.Spec.Template.Spec.Containers[0].Image
	repo, tag, _ := strings.Cut(img, ":")
	if tag != ch.Metadata.AppVersion {
		t.Errorf("chart appVersion %q, production overlay pins %s", ch.Metadata.AppVersion, img)
	}
	if got := ch.Values["image"].(map[string]any)["repository"]; got != repo {
		t.Errorf("chart image.repository %v, production overlay %s", got, repo)
	}
	if got := makeVar(t, readRepoFile(t, "Makefile"), "IMAGE"); got != repo {
		t.Errorf("Makefile IMAGE %s, manifests %s", got, repo)
	}
}

// TestHelmValuesSchema: values.schema.json rejects what a typo or a wrong
// type in a values file would otherwise render silently.
func TestHelmValuesSchema(t *testing.T) {
	ch := loadChart(t)
	for _, tc := range []struct {
		name string
		vals map[string]any
	}{
		{"unknown top-level key", map[string]any{"routr": map[string]any{"replicas": 2}}},
		{"unknown router key", map[string]any{"router": map[string]any{"replica": 2}}},
		{"wrong type", map[string]any{"router": map[string]any{"replicas": "two"}}},
		{"even NATS cluster", map[string]any{"nats": map[string]any{"replicas": 2}}},
		{"bad duration", map[string]any{"router": map[string]any{"shutdownTimeout": "30"}}},
		{"bad digest", map[string]any{"image": map[string]any{"digest": "latest"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := renderChartValues(t, ch, "kvrouter", tc.vals); err == nil || !strings.Contains(err.Error(), "schema") {
				t.Errorf("accepted %v (err %v)", tc.vals, err)
			}
		})
	}
	// Without NATS the chart needs the URL of the one to use, rather than
	// letting every router start an embedded server.
	if _, err := renderChartValues(t, ch, "kvrouter", map[string]any{"nats": map[string]any{"enabled": false}}); err == nil || !strings.Contains(err.Error(), "natsURL") {
		t.Errorf("nats.enabled=false without a URL: %v", err)
	}
}

// TestHelmExternalNATSAndEngines: with nats.enabled and vllm.enabled off,
// the chart renders neither, and routers and nothing else point at the
// given NATS; router.pools is used as given; a digest pins the image.
func TestHelmExternalNATSAndEngines(t *testing.T) {
	ch := loadChart(t)
	const natsURL = "nats://nats.shared.svc:4222"
	const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	vals := map[string]any{
		"image": map[string]any{"digest": digest},
		"nats":  map[string]any{"enabled": false},
		"vllm":  map[string]any{"enabled": false},
		"router": map[string]any{
			"config": map[string]any{"events": map[string]any{"nats": map[string]any{"url": natsURL}}},
			"pools": []any{map[string]any{"name": "qwen", "model": "Qwen/Qwen3-8B",
				"routing":   map[string]any{"strategy": "kv_aware"},
				"tokenizer": map[string]any{"source": "engine"},
				"instances": []any{map[string]any{"id": "gpu-a", "url": "http://10.0.0.7:8000"}}}},
		},
	}
	files, err := renderChartValues(t, ch, "kvrouter", vals)
	if err != nil {
		t.Fatal(err)
	}
	b := bundleOf(t, files)
	if len(b.statefulSets) != 0 {
		t.Errorf("rendered StatefulSets %v with NATS and engines off", sortedKeys(b.statefulSets))
	}
	spec, c := routerContainer(t, b)
	if want := "ghcr.io/kvrouter/kvrouter@" + digest; c.Image != want {
		t.Errorf("router image %s, want %s", c.Image, want)
	}
	text, ok := mountedFile(t, b, spec, c, mustArg(t, c.Args, "config"))
	if !ok {
		t.Fatal("router.yaml not mounted")
	}
	cfg, err := config.ParseConfig(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Events == nil || cfg.Events.NATS.URL != natsURL {
		t.Errorf("events.nats.url %+v, want %s", cfg.Events, natsURL)
	}
	if len(cfg.Pools) != 1 || cfg.Pools[0].Name != "qwen" || cfg.Pools[0].Instances[0].ID != "gpu-a" {
		t.Errorf("pools %+v, want the given qwen pool", cfg.Pools)
	}
	checkConfigWithBinary(t, text, c.Args)
}
