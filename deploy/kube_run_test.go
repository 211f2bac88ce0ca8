package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	corev1 "k8s.io/api/core/v1"
)

// pod is one pod of a rendered workload: its name (what the downward API
// gives it) and its template.
type pod struct {
	name string
	spec *corev1.PodSpec
}

// podsOf lists the pods a workload would create: StatefulSet pods are
// <name>-<ordinal>; a Deployment's are named <name>-<i> here (Kubernetes
// adds a random suffix nothing depends on).
func podsOf(w workload) []pod {
	var out []pod
	for i := range int(w.replicas) {
		out = append(out, pod{name: w.name + "-" + strconv.Itoa(i), spec: &w.template.Spec})
	}
	return out
}

// TestDevOverlayRuns runs the dev overlay's pods as local processes with
// the rendered manifests' own command lines and environment: the
// downward API (POD_NAME, POD_IP) and Secret references resolved as the
// kubelet would, each pod's loopback and each Service or pod DNS name
// mapped to local ports. NATS is configured from the rendered nats.conf.
// Then: every HTTP probe of every container answers 200; the router routes
// a request to a kvsim pod; that pod's events arrive under its pod name
// (the bridge's only identity is POD_NAME); the admin API wants the
// Secret's token; the monitors' endpoints serve the metrics the dashboard
// reads.
func TestDevOverlayRuns(t *testing.T) {
	if testing.Short() {
		t.Log("-short: the dev overlay is not started")
		return
	}
	dir, _ := bins.get(t)
	b := render(t, "kubernetes/overlays/dev")
	m := &portMap{t: t, ports: map[string]int{}, canon: kubeHosts, known: map[string]bool{}}
	var pods []pod
	for _, w := range b.workloads() {
		for _, p := range podsOf(w) {
			pods = append(pods, p)
			m.known[p.name] = true
		}
	}
	for n := range b.services {
		m.known[n] = true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// NATS from the rendered nats.conf; the Service "nats" points at it.
	sts := b.statefulSets["nats"]
	nc0 := &sts.Spec.Template.Spec.Containers[0]
	text, ok := mountedFile(t, b, &sts.Spec.Template.Spec, nc0, mustArg(t, nc0.Args, "config"))
	if !ok {
		t.Fatal("no nats.conf")
	}
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SERVER_NAME", "nats-0")
	nopts, err := natsserver.ProcessConfigFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	nopts.Host, nopts.Port, nopts.HTTPPort, nopts.PidFile = "127.0.0.1", m.local("nats", "4222"), -1, ""
	nopts.StoreDir, nopts.NoSigs, nopts.NoLog = t.TempDir(), true, true
	ns, err := natsserver.NewServer(nopts)
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats not ready")
	}

	// Our containers, engines first.
	rank := map[string]int{"kvsim": 0, "kvbridge": 1, "kvrouter": 2}
	type proc struct {
		pod  pod
		c    *corev1.Container
		args []string
		env  []string
	}
	var procs []proc
	for _, p := range pods {
		for i := range p.spec.Containers {
			c := &p.spec.Containers[i]
			bin := binaryOf(c.Command)
			if bin == "" {
				continue
			}
			procs = append(procs, proc{pod: p, c: c, args: m.localArgs(p.name, c.Args), env: kubeletEnv(t, b, p, c)})
		}
	}
	slices.SortStableFunc(procs, func(x, y proc) int { return rank[binaryOf(x.c.Command)] - rank[binaryOf(y.c.Command)] })
	for _, pr := range procs {
		bin := binaryOf(pr.c.Command)
		if bin == "kvrouter" {
			// Mount the ConfigMap: the config file, with addresses mapped.
			path := mustArg(t, pr.c.Args, "config")
			text, ok := mountedFile(t, b, pr.pod.spec, pr.c, path)
			if !ok {
				t.Fatalf("%s: %s not mounted", pr.pod.name, path)
			}
			local := filepath.Join(t.TempDir(), "router.yaml")
			if err := os.WriteFile(local, []byte(m.localText(text)), 0o600); err != nil {
				t.Fatal(err)
			}
			for i, a := range pr.args {
				if strings.HasPrefix(a, "--config=") {
					pr.args[i] = "--config=" + local
				}
			}
		}
		start(t, ctx, pr.pod.name+"/"+pr.c.Name, filepath.Join(dir, bin), pr.args, pr.env)
	}

	client := &http.Client{Timeout: 30 * time.Second}
	get := func(url string, header http.Header) (int, string, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		req.Header = header
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), nil
	}
	portURL := func(pr proc, port string, path string) string {
		n := portOf(pr.c, port)
		if n < 0 {
			n64, _ := strconv.Atoi(port)
			n = int32(n64)
		}
		return fmt.Sprintf("http://127.0.0.1:%d%s", m.local(pr.pod.name, strconv.Itoa(int(n))), path)
	}

	// Every HTTP probe answers 200 once the pods are up (readiness last:
	// the router is ready only when an engine is healthy).
	var router proc
	for _, pr := range procs {
		if binaryOf(pr.c.Command) == "kvrouter" {
			router = pr
		}
		for _, pb := range []*corev1.Probe{pr.c.StartupProbe, pr.c.LivenessProbe, pr.c.ReadinessProbe} {
			if pb == nil || pb.HTTPGet == nil {
				continue
			}
			url := portURL(pr, pb.HTTPGet.Port.String(), pb.HTTPGet.Path)
			waitFor(t, 60*time.Second, pr.pod.name+"/"+pr.c.Name+" probe "+pb.HTTPGet.Path, func() error {
				code, body, err := get(url, nil)
				if err == nil && code != http.StatusOK {
					err = fmt.Errorf("status %d: %s", code, body)
				}
				return err
			})
		}
	}
	if router.c == nil {
		t.Fatal("no router process")
	}

	// A request through the router's Service port lands on a kvsim pod.
	body := `{"model":"meta-llama/Llama-3.1-70B-Instruct","max_tokens":4,"messages":[{"role":"user","content":"` +
		strings.Repeat("Deploy overlay test prompt, long enough for several KV blocks. ", 30) + `"}]}`
	resp, err := client.Post(portURL(router, "http", "/v1/chat/completions"), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	rb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	inst := resp.Header.Get("X-Kvrouter-Instance")
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(inst, "kvsim-") {
		t.Fatalf("status %d instance %q: %s", resp.StatusCode, inst, rb)
	}

	// Identity: the bridge beside that engine has no --instance and no
	// KVBRIDGE_INSTANCE; its events carry the pod name.
	waitStreamEvents(t, ctx, ns.ClientURL(), "llama", inst)
	// And the router routes the prompt again by its index, to that pod.
	waitExactRoute(t, client, portURL(router, "http", "/v1/chat/completions"), body, inst)

	// The admin API wants the token of the rendered Secret.
	var token string
	for _, e := range router.c.Env {
		if e.Name == "KVROUTER_ADMIN_TOKEN" {
			token = string(b.secrets[e.ValueFrom.SecretKeyRef.Name].Data[e.ValueFrom.SecretKeyRef.Key])
		}
	}
	if token == "" {
		t.Fatal("no admin token in the rendered Secret")
	}
	for _, tc := range []struct {
		token string
		want  int
	}{{"", http.StatusUnauthorized}, {token, http.StatusOK}} {
		h := http.Header{}
		if tc.token != "" {
			h.Set("Authorization", "Bearer "+tc.token)
		}
		if code, body, err := get(portURL(router, "admin", "/admin/pools"), h); err != nil || code != tc.want {
			t.Errorf("admin with token %q: %d %v %s, want %d", tc.token, code, err, body, tc.want)
		}
	}

	// Scaling the engines up: a new pod (the StatefulSet's next ordinal),
	// not in router.yaml, joins the pool from its bridge's heartbeat.
	engineSts := b.statefulSets["kvsim"]
	extra := pod{name: engineSts.Name + "-" + strconv.Itoa(int(derefReplicas(engineSts.Spec.Replicas))), spec: &engineSts.Spec.Template.Spec}
	for i := range extra.spec.Containers {
		c := &extra.spec.Containers[i]
		start(t, ctx, extra.name+"/"+c.Name, filepath.Join(dir, binaryOf(c.Command)), m.localArgs(extra.name, c.Args), kubeletEnv(t, b, extra, c))
	}
	auth := http.Header{"Authorization": {"Bearer " + token}}
	waitFor(t, 30*time.Second, extra.name+" discovered from its heartbeat", func() error {
		code, body, err := get(portURL(router, "admin", "/admin/pools/llama/instances"), auth)
		if err != nil {
			return err
		}
		var v struct {
			Instances []struct {
				Instance   string `json:"instance"`
				InPool     bool   `json:"in_pool"`
				Configured bool   `json:"configured"`
				URL        string `json:"url"`
			} `json:"instances"`
		}
		if err := json.Unmarshal([]byte(body), &v); err != nil || code != http.StatusOK {
			return fmt.Errorf("status %d: %v: %s", code, err, body)
		}
		for _, in := range v.Instances {
			if in.Instance == extra.name {
				if !in.InPool || in.Configured {
					return fmt.Errorf("%+v: want in the pool, not configured", in)
				}
				// POD_IP here is loopback; in a cluster, the pod's address.
				if in.URL != "http://127.0.0.1:8000" {
					return fmt.Errorf("url %s: want http://$POD_IP:8000", in.URL)
				}
				return nil
			}
		}
		return fmt.Errorf("not listed: %s", body)
	})

	// What the ServiceMonitor and PodMonitor scrape serves what the
	// dashboard and alerts read.
	for _, tc := range []struct {
		bin, port, metric string
	}{
		{"kvrouter", "admin", "kvrouter_requests_total"},
		{"kvbridge", "bridge-metrics", "kvbridge_batches_total"},
		{"kvsim", "http", "vllm:prefix_cache_hits_total"},
	} {
		for _, pr := range procs {
			if binaryOf(pr.c.Command) != tc.bin || (tc.bin != "kvrouter" && pr.pod.name != inst) {
				continue
			}
			code, body, err := get(portURL(pr, tc.port, "/metrics"), nil)
			if err != nil || code != http.StatusOK || !strings.Contains(body, tc.metric) {
				t.Errorf("%s/%s /metrics on %s: %d %v, want %s", pr.pod.name, pr.c.Name, tc.port, code, err, tc.metric)
			}
		}
	}
}

// kubeletEnv resolves a container's environment as the kubelet would:
// values, the downward API (pod name, pod IP = loopback here) and Secret
// and ConfigMap keys from the render. Resource fields are left to the
// runtime's defaults.
func kubeletEnv(t *testing.T, b *bundle, p pod, c *corev1.Container) []string {
	t.Helper()
	var env []string
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env = append(env, e.Name+"="+e.Value)
		case e.ValueFrom.FieldRef != nil:
			switch e.ValueFrom.FieldRef.FieldPath {
			case "metadata.name":
				env = append(env, e.Name+"="+p.name)
			case "status.podIP":
				env = append(env, e.Name+"=127.0.0.1")
			default:
				t.Fatalf("%s: env %s: field %s not simulated", p.name, e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		case e.ValueFrom.SecretKeyRef != nil:
			r := e.ValueFrom.SecretKeyRef
			s, ok := b.secrets[r.Name]
			if !ok {
				t.Fatalf("%s: env %s: Secret %s not rendered", p.name, e.Name, r.Name)
			}
			env = append(env, e.Name+"="+string(s.Data[r.Key]))
		case e.ValueFrom.ConfigMapKeyRef != nil:
			r := e.ValueFrom.ConfigMapKeyRef
			env = append(env, e.Name+"="+b.configMaps[r.Name].Data[r.Key])
		case e.ValueFrom.ResourceFieldRef != nil:
			// GOMAXPROCS/GOMEMLIMIT: the Go defaults apply.
		}
	}
	return env
}
