package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/kvstream"
)

// overlay is one deployable kustomization and what it must provide.
type overlay struct {
	dir       string
	namespace string
	// minRouters is the least kvrouter replicas (and HPA minimum, when
	// there is an HPA).
	minRouters int32
	// natsNodes is the NATS StatefulSet size; 3 means a JetStream cluster.
	natsNodes int32
	// engine is the StatefulSet whose pods the router's pool lists.
	engine string
	// redis: the router's index is the shared Redis one.
	redis bool
	// externalSecrets are created out of band (never committed); every
	// other Secret reference must resolve inside the render.
	externalSecrets []string
	// production: images must be pinned.
	production bool
	// monitoring: a ServiceMonitor, a PodMonitor and the alert rules.
	monitoring bool
	// replicaSync: the router replicas share their state (events.replica_sync)
	// and reach every NATS node (docs/replicas.md).
	replicaSync bool
}

var overlays = []overlay{
	{dir: "kubernetes/overlays/dev", namespace: "kvrouter-dev", minRouters: 1, natsNodes: 1, engine: "kvsim", monitoring: true},
	{dir: "kubernetes/overlays/production", namespace: "kvrouter", minRouters: 3, natsNodes: 3, engine: "vllm", redis: true,
		externalSecrets: []string{"kvrouter-admin", "kvrouter-redis"}, production: true, monitoring: true, replicaSync: true},
	{dir: "kubernetes/overlays/production-redis-cluster", namespace: "kvrouter", minRouters: 3, natsNodes: 3, engine: "vllm", redis: true,
		externalSecrets: []string{"kvrouter-admin", "kvrouter-redis"}, production: true, monitoring: true, replicaSync: true},
}

// vllmKVEventsConfig is the engine flag value of ARCHITECTURE "vLLM KV
// events", which the bridge's endpoints must agree with.
var vllmKVEventsConfig = map[string]any{
	"enable_kv_cache_events": true, "publisher": "zmq",
	"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv",
}

func TestOverlays(t *testing.T) {
	for _, ov := range overlays {
		t.Run(filepath.Base(ov.dir), func(t *testing.T) {
			b := render(t, ov.dir)
			if _, ok := b.namespaces[ov.namespace]; !ok {
				t.Errorf("no Namespace %s", ov.namespace)
			}
			checkBundle(t, b, ov)
		})
	}
}

// checkBundle runs every check of a deployable render (a kustomize overlay
// or the Helm chart with a values file).
func checkBundle(t *testing.T, b *bundle, ov overlay) {
	t.Helper()
	for _, o := range b.objects {
		if o.kind != "Namespace" && o.namespace != ov.namespace {
			t.Errorf("%s: namespace %q, want %q", o, o.namespace, ov.namespace)
		}
	}
	checkWorkloads(t, b, ov)
	checkServices(t, b)
	checkPolicies(t, b, ov)
	if ov.monitoring {
		checkMonitors(t, b)
	} else if n := len(b.serviceMonitors) + len(b.podMonitors) + len(b.rules); n > 0 {
		t.Errorf("%d monitoring objects rendered with monitoring off (they need the Prometheus Operator's CRDs)", n)
	}
	checkOurContainers(t, b)
	cfg := checkRouter(t, b, ov)
	checkEngines(t, b, ov, cfg)
	checkNATS(t, b, ov, cfg)
	if ov.redis {
		checkRedis(t, b, cfg)
	}
}

// TestBaseRenders: the base alone decodes strictly too (it is what other
// overlays, including users' own, start from).
func TestBaseRenders(t *testing.T) {
	for _, dir := range []string{"kubernetes/base", "kubernetes/nats", "kubernetes/redis", "kubernetes/redis-cluster", "kubernetes/vllm", "kubernetes/kvsim"} {
		b := render(t, dir)
		if len(b.objects) == 0 {
			t.Errorf("%s: nothing rendered", dir)
		}
	}
}

// TestStrictDecodeRejects shows the decoder used above fails on what a
// sloppy manifest contains, so the overlay checks can fail.
func TestStrictDecodeRejects(t *testing.T) {
	for _, tc := range []struct {
		name, apiVersion, kind, y string
	}{
		{"unknown field", "apps/v1", "Deployment", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replica: 2}\n"},
		{"misplaced field", "v1", "Service", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 80, targetport: 8080}]}\n"},
		{"duplicate field", "v1", "ConfigMap", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\ndata: {c: d}\n"},
		{"wrong type", "policy/v1", "PodDisruptionBudget", "apiVersion: policy/v1\nkind: PodDisruptionBudget\nmetadata: {name: x}\nspec: {selector: [a]}\n"},
		{"unknown CRD field", "monitoring.coreos.com/v1", "PrometheusRule", "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata: {name: x}\nspec: {groups: [{name: g, rules: [{alert: A, expression: up}]}]}\n"},
		{"unregistered kind", "v1", "Pod", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n"},
		{"no name", "v1", "ConfigMap", "apiVersion: v1\nkind: ConfigMap\nmetadata: {}\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBundle("test")
			if err := b.add(objectMeta{apiVersion: tc.apiVersion, kind: tc.kind, name: "x"}, []byte(tc.y)); err == nil {
				t.Errorf("accepted:\n%s", tc.y)
			}
		})
	}
}

// checkWorkloads: selectors match their templates; every container has
// resources and (for long-running pods) probes on ports it declares;
// every volume, ConfigMap and Secret it references exists.
func checkWorkloads(t *testing.T, b *bundle, ov overlay) {
	t.Helper()
	for _, n := range sortedKeys(b.deployments) {
		d := b.deployments[n]
		if !selects(t, d.Spec.Selector, d.Spec.Template.Labels) {
			t.Errorf("Deployment/%s: selector does not match its pod template", n)
		}
	}
	for _, n := range sortedKeys(b.statefulSets) {
		s := b.statefulSets[n]
		if !selects(t, s.Spec.Selector, s.Spec.Template.Labels) {
			t.Errorf("StatefulSet/%s: selector does not match its pod template", n)
		}
		if _, ok := b.services[s.Spec.ServiceName]; !ok {
			t.Errorf("StatefulSet/%s: serviceName %q: no such Service", n, s.Spec.ServiceName)
		} else if b.services[s.Spec.ServiceName].Spec.ClusterIP != corev1.ClusterIPNone {
			t.Errorf("StatefulSet/%s: governing Service %s must be headless", n, s.Spec.ServiceName)
		}
	}
	for _, w := range b.workloads() {
		spec := &w.template.Spec
		vols := map[string]bool{}
		for _, v := range spec.Volumes {
			vols[v.Name] = true
			if v.ConfigMap != nil {
				if _, ok := b.configMaps[v.ConfigMap.Name]; !ok {
					t.Errorf("%s: volume %s: no ConfigMap %s", w, v.Name, v.ConfigMap.Name)
				}
			}
			if v.Secret != nil {
				checkSecretRef(t, b, ov, w.String(), v.Secret.SecretName, "", v.Secret.Optional)
			}
		}
		for _, c := range w.claims {
			vols[c.Name] = true
		}
		for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
			where := w.String() + " container " + c.Name
			if c.Image == "" || !strings.Contains(c.Image, ":") {
				t.Errorf("%s: image %q: want a tagged image", where, c.Image)
			}
			if strings.HasSuffix(c.Image, ":latest") && ov.production {
				t.Errorf("%s: production must pin an image, not %s", where, c.Image)
			}
			for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
				if _, ok := c.Resources.Requests[r]; !ok {
					t.Errorf("%s: no %s request", where, r)
				}
				if _, ok := c.Resources.Limits[r]; !ok {
					t.Errorf("%s: no %s limit", where, r)
				}
			}
			for _, m := range c.VolumeMounts {
				if !vols[m.Name] {
					t.Errorf("%s: volumeMount %s: no such volume or claim template", where, m.Name)
				}
			}
			ports := map[string]int32{}
			for _, p := range c.Ports {
				ports[p.Name] = p.ContainerPort
			}
			if w.kind != "Job" {
				if c.ReadinessProbe == nil || c.LivenessProbe == nil {
					t.Errorf("%s: needs readiness and liveness probes", where)
				}
				for _, p := range []*corev1.Probe{c.StartupProbe, c.ReadinessProbe, c.LivenessProbe} {
					if p == nil {
						continue
					}
					var port *intstr.IntOrString
					switch {
					case p.HTTPGet != nil:
						port = &p.HTTPGet.Port
					case p.TCPSocket != nil:
						port = &p.TCPSocket.Port
					}
					if port != nil && !containerHasPort(c, *port) {
						t.Errorf("%s: probe port %s is not a container port", where, port.String())
					}
				}
			}
			for _, e := range c.Env {
				if e.ValueFrom == nil {
					continue
				}
				if r := e.ValueFrom.SecretKeyRef; r != nil {
					checkSecretRef(t, b, ov, where+" env "+e.Name, r.Name, r.Key, r.Optional)
				}
				if r := e.ValueFrom.ConfigMapKeyRef; r != nil {
					cm, ok := b.configMaps[r.Name]
					if !ok || (cm.Data[r.Key] == "" && (r.Optional == nil || !*r.Optional)) {
						t.Errorf("%s env %s: ConfigMap %s key %s missing", where, e.Name, r.Name, r.Key)
					}
				}
			}
		}
	}
	for _, n := range sortedKeys(b.pdbs) {
		if len(podsSelected(t, b, b.pdbs[n].Spec.Selector.MatchLabels)) == 0 {
			t.Errorf("PodDisruptionBudget/%s selects no pods", n)
		}
	}
	for _, n := range sortedKeys(b.hpas) {
		h := b.hpas[n]
		ref := h.Spec.ScaleTargetRef
		if ref.Kind != "Deployment" || b.deployments[ref.Name] == nil {
			t.Errorf("HorizontalPodAutoscaler/%s: target %s/%s not rendered", n, ref.Kind, ref.Name)
		}
		if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < ov.minRouters || h.Spec.MaxReplicas < *h.Spec.MinReplicas {
			t.Errorf("HorizontalPodAutoscaler/%s: min %v max %d, want min >= %d <= max", n, h.Spec.MinReplicas, h.Spec.MaxReplicas, ov.minRouters)
		}
	}
}

func containerHasPort(c corev1.Container, p intstr.IntOrString) bool {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return true
		}
	}
	return false
}

func checkSecretRef(t *testing.T, b *bundle, ov overlay, where, name, key string, optional *bool) {
	t.Helper()
	if optional != nil && *optional {
		return
	}
	s, ok := b.secrets[name]
	if !ok {
		if !slices.Contains(ov.externalSecrets, name) {
			t.Errorf("%s: Secret %s is neither rendered nor a documented external Secret", where, name)
		}
		return
	}
	if key != "" {
		if _, ok := s.Data[key]; !ok {
			if _, ok := s.StringData[key]; !ok {
				t.Errorf("%s: Secret %s has no key %s", where, name, key)
			}
		}
	}
}

// podsSelected returns the workloads whose pod template the labels select.
func podsSelected(t *testing.T, b *bundle, sel map[string]string) []workload {
	t.Helper()
	if len(sel) == 0 {
		return nil
	}
	var out []workload
	for _, w := range b.workloads() {
		match := true
		for k, v := range sel {
			if w.template.Labels[k] != v {
				match = false
				break
			}
		}
		if match {
			out = append(out, w)
		}
	}
	return out
}

// checkServices: every Service selects pods, and its target ports exist in
// every pod it selects.
func checkServices(t *testing.T, b *bundle) {
	t.Helper()
	for _, n := range sortedKeys(b.services) {
		s := b.services[n]
		ws := podsSelected(t, b, s.Spec.Selector)
		if len(ws) == 0 {
			t.Errorf("Service/%s selects no pods", n)
			continue
		}
		for _, p := range s.Spec.Ports {
			tp := p.TargetPort
			if tp.Type == intstr.Int && tp.IntVal == 0 {
				tp = intstr.FromInt32(p.Port)
			}
			for _, w := range ws {
				found := false
				for _, c := range w.template.Spec.Containers {
					found = found || containerHasPort(c, tp)
				}
				if !found {
					t.Errorf("Service/%s port %s: target %s not a container port of %s", n, p.Name, tp.String(), w)
				}
			}
		}
	}
}

// checkPolicies: network policies select pods and allow peers that exist.
func checkPolicies(t *testing.T, b *bundle, ov overlay) {
	t.Helper()
	for _, n := range sortedKeys(b.netpols) {
		np := b.netpols[n]
		if len(podsSelected(t, b, np.Spec.PodSelector.MatchLabels)) == 0 {
			t.Errorf("NetworkPolicy/%s selects no pods", n)
		}
		for _, in := range np.Spec.Ingress {
			for _, from := range in.From {
				if from.PodSelector != nil && len(podsSelected(t, b, from.PodSelector.MatchLabels)) == 0 {
					t.Errorf("NetworkPolicy/%s: peer %v selects no pods", n, from.PodSelector.MatchLabels)
				}
			}
		}
	}
}

// checkMonitors: the ServiceMonitor and PodMonitor find their targets and
// name ports that exist.
func checkMonitors(t *testing.T, b *bundle) {
	t.Helper()
	if len(b.serviceMonitors) == 0 || len(b.podMonitors) == 0 || len(b.rules) == 0 {
		t.Errorf("want a ServiceMonitor, a PodMonitor and a PrometheusRule; have %d, %d, %d", len(b.serviceMonitors), len(b.podMonitors), len(b.rules))
	}
	for _, n := range sortedKeys(b.serviceMonitors) {
		sm := b.serviceMonitors[n]
		var svcs []*corev1.Service
		for _, sn := range sortedKeys(b.services) {
			if selects(t, &sm.Spec.Selector, b.services[sn].Labels) {
				svcs = append(svcs, b.services[sn])
			}
		}
		if len(svcs) == 0 {
			t.Errorf("ServiceMonitor/%s selects no Service", n)
		}
		for _, ep := range sm.Spec.Endpoints {
			for _, s := range svcs {
				if !slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return ep.Port != "" && p.Name == ep.Port }) {
					t.Errorf("ServiceMonitor/%s: Service %s has no port %v", n, s.Name, ep.Port)
				}
			}
		}
	}
	for _, n := range sortedKeys(b.podMonitors) {
		pm := b.podMonitors[n]
		ws := podsSelected(t, b, pm.Spec.Selector.MatchLabels)
		if len(ws) == 0 {
			t.Errorf("PodMonitor/%s selects no pods", n)
		}
		for _, ep := range pm.Spec.PodMetricsEndpoints {
			for _, w := range ws {
				found := false
				for _, c := range w.template.Spec.Containers {
					found = found || (ep.Port != nil && containerHasPort(c, intstr.FromString(*ep.Port)))
				}
				if !found {
					t.Errorf("PodMonitor/%s: %s has no port %v", n, w, ep.Port)
				}
			}
		}
	}
}

// checkOurContainers: every container running kvrouter, kvbridge or kvsim
// passes only flags the binary has, and only environment variables it reads.
func checkOurContainers(t *testing.T, b *bundle) {
	t.Helper()
	runtimeEnv := []string{"GOMAXPROCS", "GOMEMLIMIT", "GOGC"}
	n := 0
	for _, w := range b.workloads() {
		for _, c := range w.template.Spec.Containers {
			bin := binaryOf(c.Command)
			if bin == "" {
				continue
			}
			n++
			where := w.String() + " container " + c.Name
			checkArgs(t, where, bin, c.Args)
			for _, e := range c.Env {
				if !slices.Contains(runtimeEnv, e.Name) && !envReadBy(t, bin, e.Name) {
					t.Errorf("%s: env %s is not read by %s", where, e.Name, bin)
				}
				if e.Name == "GOMEMLIMIT" {
					checkMemLimit(t, where, e.Value, c.Resources.Limits.Memory().Value())
				}
			}
		}
	}
	if n == 0 {
		t.Error("no container runs a project binary")
	}
}

// goMemLimit parses a GOMEMLIMIT value (bytes, or a number with B, KiB,
// MiB, GiB or TiB, as the Go runtime accepts it).
func goMemLimit(v string) (int64, error) {
	units := []struct {
		suf  string
		mult int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}}
	mult := int64(1)
	for _, u := range units {
		if n, ok := strings.CutSuffix(v, u.suf); ok {
			v, mult = n, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("GOMEMLIMIT %q: want a positive size", v)
	}
	return n * mult, nil
}

// checkMemLimit: the Go soft memory limit sits between 70% and 95% of the
// container's memory limit: above, the kernel kills before the GC reacts;
// far below, memory paid for goes unused.
func checkMemLimit(t *testing.T, where, v string, limit int64) {
	t.Helper()
	n, err := goMemLimit(v)
	if err != nil {
		t.Errorf("%s: %v", where, err)
		return
	}
	if limit <= 0 || n*100 > limit*95 || n*100 < limit*70 {
		t.Errorf("%s: GOMEMLIMIT %s is not 70..95%% of the memory limit %d", where, v, limit)
	}
}

func TestGoMemLimit(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want int64
		ok   bool
	}{{"1843MiB", 1843 << 20, true}, {"2GiB", 2 << 30, true}, {"1000", 1000, true}, {"12XB", 0, false}, {"-1MiB", 0, false}} {
		got, err := goMemLimit(tc.v)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("%s: %d %v, want %d ok=%v", tc.v, got, err, tc.want, tc.ok)
		}
	}
}

// routerContainer returns the kvrouter Deployment's router container.
func routerContainer(t *testing.T, b *bundle) (*corev1.PodSpec, *corev1.Container) {
	t.Helper()
	d, ok := b.deployments["kvrouter"]
	if !ok {
		t.Fatal("no Deployment kvrouter")
	}
	for i := range d.Spec.Template.Spec.Containers {
		c := &d.Spec.Template.Spec.Containers[i]
		if binaryOf(c.Command) == "kvrouter" {
			return &d.Spec.Template.Spec, c
		}
	}
	t.Fatal("Deployment kvrouter runs no kvrouter container")
	return nil, nil
}

// mountedFile returns the content of the file at p as mounted from a
// ConfigMap volume.
func mountedFile(t *testing.T, b *bundle, spec *corev1.PodSpec, c *corev1.Container, p string) (string, bool) {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if path.Dir(p) != path.Clean(m.MountPath) {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.ConfigMap != nil {
				cm, ok := b.configMaps[v.ConfigMap.Name]
				if !ok {
					return "", false
				}
				s, ok := cm.Data[path.Base(p)]
				return s, ok
			}
		}
	}
	return "", false
}

// checkRouter: replicas, probes, admin token from a Secret, ports agreeing
// with the flags, and router.yaml valid by the router's own validation and
// the binary's --check-config.
func checkRouter(t *testing.T, b *bundle, ov overlay) config.Config {
	t.Helper()
	d := b.deployments["kvrouter"]
	spec, c := routerContainer(t, b)
	r := derefReplicas(d.Spec.Replicas)
	if h, ok := b.hpas["kvrouter"]; ok && d.Spec.Replicas == nil && h.Spec.MinReplicas != nil {
		r = *h.Spec.MinReplicas // left to the autoscaler (a chart upgrade then never resets it)
	}
	if r < ov.minRouters {
		t.Errorf("kvrouter replicas %d, want >= %d", r, ov.minRouters)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("kvrouter readiness probe: want GET /readyz")
	}
	if c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("kvrouter liveness probe: want GET /healthz")
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	if e, ok := env["KVROUTER_ADMIN_TOKEN"]; !ok || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
		t.Errorf("KVROUTER_ADMIN_TOKEN must come from a Secret")
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for flagName, portName := range map[string]string{"listen": "http", "admin-listen": "admin"} {
		v, ok := argValue(c.Args, flagName)
		if !ok {
			t.Errorf("kvrouter: --%s not set", flagName)
			continue
		}
		if _, p, err := net.SplitHostPort(v); err != nil || p != strconv.Itoa(int(ports[portName])) {
			t.Errorf("kvrouter --%s=%s does not listen on container port %s (%d)", flagName, v, portName, ports[portName])
		}
	}
	if d.Spec.Template.Spec.TerminationGracePeriodSeconds != nil {
		if v, ok := argValue(c.Args, "shutdown-timeout"); ok {
			if dur, err := time.ParseDuration(v); err != nil || dur.Seconds() >= float64(*d.Spec.Template.Spec.TerminationGracePeriodSeconds) {
				t.Errorf("terminationGracePeriodSeconds %d must exceed --shutdown-timeout=%s", *d.Spec.Template.Spec.TerminationGracePeriodSeconds, v)
			}
		}
	}

	cfgPath, ok := argValue(c.Args, "config")
	if !ok {
		t.Fatal("kvrouter: no --config")
	}
	text, ok := mountedFile(t, b, spec, c, cfgPath)
	if !ok {
		t.Fatalf("kvrouter --config=%s is not a file of a mounted ConfigMap", cfgPath)
	}
	cfg, err := config.ParseConfig(strings.NewReader(text))
	if err != nil {
		t.Fatalf("router.yaml: %v", err)
	}
	// What cmd/kvrouter does: secrets from the environment, then defaults
	// and validation.
	cfg.AdminToken = "set-from-secret"
	if cfg.Index != nil && cfg.Index.Redis != nil {
		cfg.Index.Redis.Password = "set-from-secret"
		if _, ok := env["KVROUTER_REDIS_PASSWORD"]; !ok {
			t.Errorf("index.backend redis but no KVROUTER_REDIS_PASSWORD env")
		}
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("router.yaml fails the router's validation: %v", err)
	}
	cfg = cfg.WithDefaults()
	checkConfigWithBinary(t, text, c.Args)
	wantBackend := "memory"
	if ov.redis {
		wantBackend = "redis"
	}
	if cfg.Index == nil || (cfg.Index.Backend != wantBackend && !(wantBackend == "memory" && cfg.Index.Backend == "")) {
		t.Errorf("router.yaml index backend: want %s", wantBackend)
	}
	if cfg.Events == nil || cfg.Events.NATS.URL == "" {
		t.Errorf("router.yaml: events.nats.url must name the cluster's NATS")
	}
	if ov.replicaSync {
		checkReplicaSync(t, cfg, ov)
	}
	return cfg
}

// checkReplicaSync: several router replicas share their router-local
// state, each under its own name, and reach every NATS node, whose stream
// keeps a copy on each (docs/replicas.md).
func checkReplicaSync(t *testing.T, cfg config.Config, ov overlay) {
	t.Helper()
	rs := cfg.Events.ReplicaSync
	if rs == nil || !rs.Enabled {
		t.Errorf("router.yaml: %d replicas without events.replica_sync", ov.minRouters)
		return
	}
	if rs.Replica != "" {
		t.Errorf("events.replica_sync.replica %q: every pod of the Deployment would share it (leave it empty: hostname-pid)", rs.Replica)
	}
	if got := len(strings.Split(cfg.Events.NATS.URL, ",")); got != int(ov.natsNodes) {
		t.Errorf("events.nats.url %q: %d seed URLs, want one per NATS node (%d)", cfg.Events.NATS.URL, got, ov.natsNodes)
	}
	if cfg.Events.NATS.StreamReplicas != int(ov.natsNodes) {
		t.Errorf("events.nats.stream_replicas %d, want %d (one copy per node)", cfg.Events.NATS.StreamReplicas, ov.natsNodes)
	}
}

// checkConfigWithBinary runs the real binary with the manifest's flags and
// --check-config on the rendered file.
func checkConfigWithBinary(t *testing.T, text string, args []string) {
	t.Helper()
	dir, _ := bins.get(t)
	f := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(f, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	var a []string
	for _, arg := range args {
		if n, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "="); n != "config" {
			a = append(a, arg)
		}
	}
	a = append(a, "--config="+f, "--check-config")
	cmd := exec.Command(filepath.Join(dir, "kvrouter"), a...)
	cmd.Env = append(os.Environ(), "KVROUTER_ADMIN_TOKEN=x", "KVROUTER_REDIS_PASSWORD=x")
	if out, err := cmd.CombinedOutput(); err != nil || !bytes.Contains(out, []byte("configuration ok")) {
		t.Errorf("kvrouter %s: %v\n%s", strings.Join(a, " "), err, out)
	}
}

// checkEngines: the pool's instances are exactly the engine StatefulSet's
// pods, at their stable DNS names, each with a kvbridge sidecar publishing
// under the pod's name to the pool, reading the ZMQ endpoints the engine
// binds.
func checkEngines(t *testing.T, b *bundle, ov overlay, cfg config.Config) {
	t.Helper()
	sts, ok := b.statefulSets[ov.engine]
	if !ok {
		t.Fatalf("no engine StatefulSet %s", ov.engine)
	}
	if len(cfg.Pools) != 1 {
		t.Fatalf("router.yaml: want one pool, have %d", len(cfg.Pools))
	}
	pool := cfg.Pools[0]
	replicas := derefReplicas(sts.Spec.Replicas)
	if int(replicas) != len(pool.Instances) {
		t.Errorf("pool %s lists %d instances, StatefulSet %s has %d pods", pool.Name, len(pool.Instances), sts.Name, replicas)
	}
	var engine, bridge *corev1.Container
	for i := range sts.Spec.Template.Spec.Containers {
		c := &sts.Spec.Template.Spec.Containers[i]
		if binaryOf(c.Command) == "kvbridge" {
			bridge = c
		} else {
			engine = c
		}
	}
	if engine == nil || bridge == nil {
		t.Fatalf("StatefulSet %s: want an engine container and a kvbridge sidecar", sts.Name)
	}
	var enginePort int32
	for _, p := range engine.Ports {
		if p.Name == "http" {
			enginePort = p.ContainerPort
		}
	}
	for i, in := range pool.Instances {
		wantID := sts.Name + "-" + strconv.Itoa(i)
		if in.ID != wantID {
			t.Errorf("pool %s instance %d: id %q, want the pod name %q", pool.Name, i, in.ID, wantID)
		}
		u, err := url.Parse(in.URL)
		if err != nil {
			t.Errorf("instance %s: %v", in.ID, err)
			continue
		}
		if want := wantID + "." + sts.Spec.ServiceName + ":" + strconv.Itoa(int(enginePort)); u.Host != want {
			t.Errorf("instance %s: url host %q, want the pod's stable name %q", in.ID, u.Host, want)
		}
	}

	// Identity: the pod name, through the downward API.
	identity := false
	for _, e := range bridge.Env {
		if e.Name == "POD_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name" {
			identity = true
		}
	}
	if _, explicit := argValue(bridge.Args, "instance"); explicit || !identity {
		t.Errorf("kvbridge in %s: identity must come from POD_NAME (downward API metadata.name), not --instance", sts.Name)
	}
	if v, _ := argValue(bridge.Args, "pool"); v != pool.Name {
		t.Errorf("kvbridge --pool=%q, router pool %q", v, pool.Name)
	}
	if v, _ := argValue(bridge.Args, "model"); v != pool.Model {
		t.Errorf("kvbridge --model=%q, router pool model %q", v, pool.Model)
	}
	if v, _ := argValue(bridge.Args, "nats-url"); v != cfg.Events.NATS.URL {
		t.Errorf("kvbridge --nats-url=%q, router events.nats.url %q: both must use the cluster's NATS", v, cfg.Events.NATS.URL)
	}
	checkServiceURL(t, b, "kvbridge --nats-url", mustArg(t, bridge.Args, "nats-url"))
	if v, _ := argValue(bridge.Args, "listen"); !strings.HasSuffix(v, ":"+strconv.Itoa(int(portOf(bridge, "bridge-metrics")))) {
		t.Errorf("kvbridge --listen=%s is not its bridge-metrics port", v)
	}

	// What the engine publishes, and where, and its first seq (vLLM's 0,
	// kvbridge's default).
	var pub, replay, topic string
	firstSeq := 0
	switch binaryOf(engine.Command) {
	case "kvsim":
		firstSeq = kvsimFirstSeq
		host, _ := argValue(engine.Args, "zmq-host")
		port, _ := argValue(engine.Args, "zmq-port")
		rport, _ := argValue(engine.Args, "replay-port")
		pub, replay = "tcp://"+net.JoinHostPort(host, port), "tcp://"+net.JoinHostPort(host, rport)
		topic, _ = argValue(engine.Args, "topic")
	case "":
		pub, replay, topic = vllmEndpoints(t, "engine "+sts.Name, engine.Args)
	default:
		t.Fatalf("engine container of %s runs %s", sts.Name, binaryOf(engine.Command))
	}
	checkBridgeEndpoints(t, "StatefulSet "+sts.Name, bridge.Args, pub, replay, topic)
	checkBridgeFirstSeq(t, "StatefulSet "+sts.Name, bridge.Args, firstSeq)
}

// kvsimFirstSeq is the seq kvsim numbers its first message
// (simserver.FirstSeq, as llm-d-inference-sim does), which its bridge is
// told with --first-seq; not imported, to keep the simulator's
// dependencies out of this module.
const kvsimFirstSeq = 1

// checkBridgeFirstSeq: a kvbridge is told the seq its engine counts from
// (--first-seq, default 0): with another, the engine's whole history reads
// as one that lost its first messages.
func checkBridgeFirstSeq(t *testing.T, where string, args []string, want int) {
	t.Helper()
	v, ok := argValue(args, "first-seq")
	if !ok {
		v = "0"
	}
	if v != strconv.Itoa(want) {
		t.Errorf("%s: kvbridge --first-seq=%s, its engine counts from %d", where, v, want)
	}
}

func mapsEqual(a, b map[string]any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y) // json.Marshal sorts map keys
}

func mustArg(t *testing.T, args []string, name string) string {
	t.Helper()
	v, ok := argValue(args, name)
	if !ok {
		t.Errorf("--%s missing in %v", name, args)
	}
	return v
}

func portOf(c *corev1.Container, name string) int32 {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return -1
}

// checkServiceURL checks that a URL's host:port is a rendered Service's
// name and port (the short in-namespace DNS name).
func checkServiceURL(t *testing.T, b *bundle, where, raw string) {
	t.Helper()
	for _, one := range strings.Split(raw, ",") {
		host, port := one, ""
		if u, err := url.Parse(one); err == nil && u.Host != "" {
			host = u.Host
		}
		h, p, err := net.SplitHostPort(host)
		if err != nil {
			t.Errorf("%s %q: %v", where, one, err)
			continue
		}
		host, port = h, p
		if pod, svc, ok := strings.Cut(host, "."); ok && statefulPod(b, pod, svc) {
			host = svc // a StatefulSet pod's stable name under its headless Service
		}
		s, ok := b.services[host]
		if !ok {
			t.Errorf("%s %q: no Service %s", where, one, host)
			continue
		}
		if !slices.ContainsFunc(s.Spec.Ports, func(sp corev1.ServicePort) bool { return strconv.Itoa(int(sp.Port)) == port }) {
			t.Errorf("%s %q: Service %s has no port %s", where, one, host, port)
		}
	}
}

// statefulPod reports whether pod is one of the pods of a StatefulSet
// whose serviceName is the headless Service svc ("nats-2" of nats with
// three replicas under nats-headless).
func statefulPod(b *bundle, pod, svc string) bool {
	i := strings.LastIndexByte(pod, '-')
	if i < 0 {
		return false
	}
	sts, ok := b.statefulSets[pod[:i]]
	n, err := strconv.Atoi(pod[i+1:])
	if !ok || err != nil || sts.Spec.ServiceName != svc || n < 0 || n >= int(derefReplicas(sts.Spec.Replicas)) {
		return false
	}
	s, ok := b.services[svc]
	return ok && s.Spec.ClusterIP == corev1.ClusterIPNone
}

// checkNATS: the NATS server's own parser accepts the config; JetStream is
// on; a cluster's routes name every peer by its stable DNS name; the ports
// agree with the container; the router reaches it; production's stream
// and bucket are replicated across the cluster.
func checkNATS(t *testing.T, b *bundle, ov overlay, cfg config.Config) {
	t.Helper()
	checkServiceURL(t, b, "router events.nats.url", cfg.Events.NATS.URL)
	sts, ok := b.statefulSets["nats"]
	if !ok {
		t.Fatal("no StatefulSet nats")
	}
	if r := derefReplicas(sts.Spec.Replicas); r != ov.natsNodes {
		t.Errorf("nats replicas %d, want %d", r, ov.natsNodes)
	}
	spec := &sts.Spec.Template.Spec
	c := &spec.Containers[0]
	confPath := mustArg(t, c.Args, "config")
	text, ok := mountedFile(t, b, spec, c, confPath)
	if !ok {
		t.Fatalf("nats --config=%s is not a mounted ConfigMap file", confPath)
	}
	f := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(f, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SERVER_NAME", "nats-0") // what the downward API gives pod 0
	opts, err := natsserver.ProcessConfigFile(f)
	if err != nil {
		t.Fatalf("nats.conf rejected by nats-server: %v", err)
	}
	if opts.ServerName != "nats-0" {
		t.Errorf("nats server_name %q: want it from $SERVER_NAME", opts.ServerName)
	}
	if !opts.JetStream {
		t.Error("nats.conf: JetStream is off")
	}
	if opts.Port != int(portOf(c, "client")) || opts.HTTPPort != int(portOf(c, "monitor")) {
		t.Errorf("nats.conf ports client %d monitor %d, container %d %d", opts.Port, opts.HTTPPort, portOf(c, "client"), portOf(c, "monitor"))
	}
	storeMounted := slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
		return strings.HasPrefix(opts.StoreDir, path.Clean(m.MountPath)+"/") && slices.ContainsFunc(sts.Spec.VolumeClaimTemplates, func(p corev1.PersistentVolumeClaim) bool { return p.Name == m.Name })
	})
	if !storeMounted {
		t.Errorf("nats JetStream store_dir %s is not on a persistent volume", opts.StoreDir)
	}
	// JetStream reserves a stream's max bytes up front: the events stream
	// must leave room in the store for the snapshot bucket, or the bucket's
	// creation fails (insufficient resources). Whichever comes first
	// creates the stream: the router's consumer with the default size, or
	// a bridge with its --stream-max-bytes.
	const defaultStreamBytes = 1 << 30 // kvstream.StreamConfig default
	if opts.JetStreamMaxStore > 0 && defaultStreamBytes >= opts.JetStreamMaxStore*3/4 {
		t.Errorf("the router's default 1 GiB stream leaves too little of the %d-byte JetStream store for the snapshot bucket", opts.JetStreamMaxStore)
	}
	for _, w := range b.workloads() {
		for _, c := range w.template.Spec.Containers {
			if binaryOf(c.Command) != "kvbridge" {
				continue
			}
			maxBytes := int64(defaultStreamBytes)
			if v, ok := argValue(c.Args, "stream-max-bytes"); ok {
				if maxBytes, err = strconv.ParseInt(v, 10, 64); err != nil {
					t.Errorf("%s: --stream-max-bytes=%s: %v", w, v, err)
				}
			}
			if opts.JetStreamMaxStore > 0 && maxBytes >= opts.JetStreamMaxStore*3/4 {
				t.Errorf("%s: stream of %d bytes leaves too little of the %d-byte JetStream store for the snapshot bucket", w, maxBytes, opts.JetStreamMaxStore)
			}
		}
	}
	if ov.natsNodes > 1 {
		if opts.Cluster.Port != int(portOf(c, "cluster")) {
			t.Errorf("nats cluster port %d, container %d", opts.Cluster.Port, portOf(c, "cluster"))
		}
		var got []string
		for _, r := range opts.Routes {
			got = append(got, r.Host)
		}
		var want []string
		for i := range int(ov.natsNodes) {
			want = append(want, "nats-"+strconv.Itoa(i)+"."+sts.Spec.ServiceName+":"+strconv.Itoa(opts.Cluster.Port))
		}
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("nats routes %v, want every peer %v", got, want)
		}
		checkStreamJob(t, b, ov, cfg)
	} else if len(opts.Routes) > 0 {
		t.Errorf("single-node NATS with cluster routes %v", opts.Routes)
	}
}

// checkStreamJob: the init Job creates the stream the bridges publish to and
// the routers read, over the events subjects, replicated on every node.
func checkStreamJob(t *testing.T, b *bundle, ov overlay, cfg config.Config) {
	t.Helper()
	j, ok := b.jobs["nats-streams-init"]
	if !ok {
		t.Error("a NATS cluster needs the nats-streams-init Job (replicated stream and bucket)")
		return
	}
	script := strings.Join(j.Spec.Template.Spec.Containers[0].Args, " ")
	stream := cfg.Events.NATS.Stream
	if stream == "" {
		stream = kvstream.DefaultStreamName
	}
	for _, want := range []string{
		"stream add " + stream + " ",
		"--subjects='" + kvstream.SubjectEvents + ".>'",
		"kv add " + kvstream.DefaultBucketName + " ",
	} {
		if !strings.Contains(script, want) {
			t.Errorf("nats-streams-init: %q not in its script", want)
		}
	}
	if n := strings.Count(script, "--replicas="+strconv.Itoa(int(ov.natsNodes))); n != 2 {
		t.Errorf("nats-streams-init: stream and bucket must both use --replicas=%d", ov.natsNodes)
	}
	for _, e := range j.Spec.Template.Spec.Containers[0].Env {
		if e.Name == "NATS_URL" {
			checkServiceURL(t, b, "nats-streams-init NATS_URL", e.Value)
		}
	}
}

// checkRedis: the router's Redis address is the rendered Redis Service, and
// router and Redis take the password from the same Secret key.
func checkRedis(t *testing.T, b *bundle, cfg config.Config) {
	t.Helper()
	if cfg.Index == nil || cfg.Index.Redis == nil {
		t.Fatal("no index.redis")
	}
	for _, a := range cfg.Index.Redis.Addrs {
		checkServiceURL(t, b, "index.redis.addrs", "redis://"+a)
	}
	_, rc := routerContainer(t, b)
	ref := func(c *corev1.Container, name string) string {
		for _, e := range c.Env {
			if e.Name == name && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				return e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
			}
		}
		return ""
	}
	var rs *corev1.Container
	where := "Deployment/redis"
	if cfg.Index.Redis.Cluster {
		rs, where = checkRedisCluster(t, b, cfg.Index.Redis), "StatefulSet/redis-cluster"
	} else {
		rd, ok := b.deployments["redis"]
		if !ok {
			t.Fatal("no Deployment redis")
		}
		rs = &rd.Spec.Template.Spec.Containers[0]
	}
	if got, want := ref(rc, "KVROUTER_REDIS_PASSWORD"), ref(rs, "REDIS_PASSWORD"); got == "" || got != want {
		t.Errorf("router password from %q, Redis from %q: want the same Secret key", got, want)
	}
	// The kubelet expands $(REDIS_PASSWORD) in args; the router reads the
	// same Secret key.
	checkRedisACL(t, where, rs.Args, cfg.Index.Redis, "$(REDIS_PASSWORD)")
}

// checkRedisCluster: the index on a Redis Cluster names every node of the
// StatefulSet as a seed; the nodes run in cluster mode with their node
// file on a volume that outlives the pod, announce their stable DNS names,
// replicate with a user of their own; the create Job joins exactly those
// nodes, three masters with one replica each. Returns the Redis container.
func checkRedisCluster(t *testing.T, b *bundle, rc *config.RedisConfig) *corev1.Container {
	t.Helper()
	sts, ok := b.statefulSets["redis-cluster"]
	if !ok {
		t.Fatal("index.redis.cluster: no StatefulSet redis-cluster")
	}
	n := int(derefReplicas(sts.Spec.Replicas))
	if n != 6 {
		t.Errorf("StatefulSet/redis-cluster: %d pods, want 6 (3 masters, 3 replicas)", n)
	}
	var want []string
	for i := range n {
		want = append(want, fmt.Sprintf("redis-cluster-%d.%s:6379", i, sts.Spec.ServiceName))
	}
	if !slices.Equal(rc.Addrs, want) {
		t.Errorf("index.redis.addrs %v, want every node %v", rc.Addrs, want)
	}
	c := &sts.Spec.Template.Spec.Containers[0]
	arg := func(name string) string { return mustRedisArg(t, c.Args, name) }
	if arg("cluster-enabled") != "yes" {
		t.Error("StatefulSet/redis-cluster: not --cluster-enabled yes")
	}
	onClaim := func(path string) bool {
		return slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
			return (path == m.MountPath || strings.HasPrefix(path, m.MountPath+"/")) &&
				slices.ContainsFunc(sts.Spec.VolumeClaimTemplates, func(v corev1.PersistentVolumeClaim) bool { return v.Name == m.Name })
		})
	}
	if nodes := arg("cluster-config-file"); !onClaim(nodes) {
		t.Errorf("StatefulSet/redis-cluster: node file %s is not on a volume claim (a restarted pod would rejoin as a stranger)", nodes)
	}
	// A master restarted before failover keeps its node id: without its
	// data on disk it would come back empty, unseen by the routers' epoch.
	if arg("appendonly") != "yes" || !onClaim(arg("dir")) {
		t.Errorf("StatefulSet/redis-cluster: appendonly %q in --dir %q: want the append-only file on the volume claim", arg("appendonly"), arg("dir"))
	}
	if got := arg("cluster-announce-hostname"); got != "$(POD_NAME)."+sts.Spec.ServiceName {
		t.Errorf("StatefulSet/redis-cluster: announces %q, want its stable DNS name", got)
	}
	users := redisUsers(c.Args)
	if u := arg("masteruser"); !users[u].on || u == rc.Username {
		t.Errorf("StatefulSet/redis-cluster: replicas authenticate as %q: want an enabled user other than the routers'", u)
	}
	job, ok := b.jobs["redis-cluster-create"]
	if !ok {
		t.Fatal("no Job redis-cluster-create")
	}
	script := strings.Join(job.Spec.Template.Spec.Containers[0].Args, " ")
	for _, a := range want {
		if !strings.Contains(script, a) {
			t.Errorf("Job/redis-cluster-create does not join %s", a)
		}
	}
	if !strings.Contains(script, "--cluster-replicas 1") {
		t.Error("Job/redis-cluster-create: not --cluster-replicas 1")
	}
	return c
}
