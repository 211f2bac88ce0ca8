package deploy

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// portMap gives every (host, port) of a deployment a free local port, so
// that its topology runs as plain processes on 127.0.0.1. Hosts are
// canonical names: a compose service, a Kubernetes Service or pod.
type portMap struct {
	t     *testing.T
	ports map[string]int // "host:port" -> local port
	// canon maps a host as written (a DNS name, 0.0.0.0, 127.0.0.1) to its
	// canonical name; self is the process's own host (pod or service).
	canon func(host, self string) string
	// known are the canonical hosts whose addresses are rewritten in files.
	known map[string]bool
}

// composeHosts: compose services reach each other by service name.
func composeHosts(host, self string) string {
	if host == "" || host == "0.0.0.0" {
		return self
	}
	return host
}

// kubeHosts: containers of a pod share its loopback; other pods and
// Services are reached by DNS names whose first label names them
// (vllm-0.vllm, nats, redis).
func kubeHosts(host, self string) string {
	switch host {
	case "", "0.0.0.0", "127.0.0.1", "localhost":
		return self
	}
	first, _, _ := strings.Cut(host, ".")
	return first
}

func (m *portMap) local(host, port string) int {
	k := host + ":" + port
	if p, ok := m.ports[k]; ok {
		return p
	}
	p := testenv.FreePort(m.t)
	m.ports[k] = p
	return p
}

// hostPortValue matches flag values naming an address: tcp://h:p, http://h:p/x, h:p, :p.
var hostPortValue = regexp.MustCompile(`^([a-z]+://)?([A-Za-z0-9.-]*):(\d+)(/.*)?$`)

// localArgs rewrites a process's flags for a local run: addresses become
// 127.0.0.1 and the mapped port (listen addresses keep their empty host);
// wildcard binds become loopback. Nothing else changes.
func (m *portMap) localArgs(self string, args []string) []string {
	out := make([]string, 0, len(args))
	for _, a := range args {
		name, v, ok := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !ok || !strings.HasPrefix(a, "-") {
			out = append(out, a)
			continue
		}
		switch {
		case hostPortValue.MatchString(v):
			g := hostPortValue.FindStringSubmatch(v)
			p := strconv.Itoa(m.local(m.canon(g[2], self), g[3]))
			if g[2] == "" {
				v = g[1] + ":" + p + g[4]
			} else {
				v = g[1] + "127.0.0.1:" + p + g[4]
			}
		case name == "port" || name == "zmq-port" || name == "replay-port":
			v = strconv.Itoa(m.local(self, v))
		case v == "0.0.0.0":
			v = "127.0.0.1"
		}
		out = append(out, "--"+name+"="+v)
	}
	return out
}

// addrInText matches host:port in a config file.
var addrInText = regexp.MustCompile(`([A-Za-z0-9][A-Za-z0-9.-]*):(\d+)`)

// localText rewrites every address of a known host in a config file.
func (m *portMap) localText(s string) string {
	return addrInText.ReplaceAllStringFunc(s, func(a string) string {
		g := addrInText.FindStringSubmatch(a)
		h := m.canon(g[1], "")
		if !m.known[h] {
			return a
		}
		return "127.0.0.1:" + strconv.Itoa(m.local(h, g[2]))
	})
}

// tail is the end of a process's output, for failure messages.
func tail(out *testenv.Logs) string {
	s := out.String()
	if len(s) > 3000 {
		s = "…" + s[len(s)-3000:]
	}
	return s
}

func TestLocalArgs(t *testing.T) {
	m := &portMap{t: t, ports: map[string]int{"kvsim-0:5557": 40001, "kvsim-0:8000": 40002, "kvbridge-0:9400": 40003, "kvsim-0:5558": 40004}, canon: composeHosts, known: map[string]bool{"kvsim-0": true}}
	got := m.localArgs("kvsim-0", []string{"--zmq-endpoint=tcp://kvsim-0:5557", "--engine-url=http://kvsim-0:8000/x", "--host=0.0.0.0", "--port=8000", "--replay-port=5558", "--topic=kv", "--flag"})
	want := []string{"--zmq-endpoint=tcp://127.0.0.1:40001", "--engine-url=http://127.0.0.1:40002/x", "--host=127.0.0.1", "--port=40002", "--replay-port=40004", "--topic=kv", "--flag"}
	if !slices.Equal(got, want) {
		t.Errorf("got %v\nwant %v", got, want)
	}
	if got := m.localArgs("kvbridge-0", []string{"--listen=:9400"}); got[0] != "--listen=:40003" {
		t.Errorf("listen: %v", got)
	}
	if got := m.localText("url: http://kvsim-0:8000\nother: http://example.com:80\n"); got != "url: http://127.0.0.1:40002\nother: http://example.com:80\n" {
		t.Errorf("localText: %q", got)
	}
	k := &portMap{t: t, ports: map[string]int{"vllm-0:5557": 40005, "vllm-0:8000": 40006}, canon: kubeHosts, known: map[string]bool{"vllm-0": true}}
	if got := k.localArgs("vllm-0", []string{"--zmq-endpoint=tcp://127.0.0.1:5557"}); got[0] != "--zmq-endpoint=tcp://127.0.0.1:40005" {
		t.Errorf("pod loopback: %v", got)
	}
	if got := k.localText("url: http://vllm-0.vllm:8000"); got != "url: http://127.0.0.1:40006" {
		t.Errorf("pod DNS name: %q", got)
	}
}

// TestComposeRuns runs the compose topology with the real binaries, as
// local processes with the compose file's own flags (addresses mapped to
// loopback ports): NATS from the compose nats command line (parsed by
// nats-server's own flag parser), redis-server with the compose redis
// command line, every kvsim, kvbridge and kvrouter service. It then checks
// what a user of `docker compose up` would: both routers become ready and
// route a request alike, the bridges' events reach the JetStream stream,
// the admin API wants the token, and Redis wants the password.
func TestComposeRuns(t *testing.T) {
	if testing.Short() {
		t.Log("-short: the compose topology is not started")
		return
	}
	dir, _ := bins.get(t)
	cf := loadCompose(t)
	m := &portMap{t: t, ports: map[string]int{}, canon: composeHosts, known: map[string]bool{}}
	for n := range cf.Services {
		m.known[n] = true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// NATS, configured by the compose command line.
	natsSvc := cf.Services["nats"]
	fs := flag.NewFlagSet("nats-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	nopts, err := natsserver.ConfigureOptions(fs, natsSvc.Command, func() {}, func() {}, func() {})
	if err != nil {
		t.Fatalf("compose nats command %v: %v", natsSvc.Command, err)
	}
	if !nopts.JetStream {
		t.Error("compose nats: JetStream is off")
	}
	nopts.Host, nopts.Port, nopts.HTTPPort = "127.0.0.1", m.local("nats", "4222"), -1
	nopts.StoreDir, nopts.NoSigs, nopts.NoLog = t.TempDir(), true, true
	ns, err := natsserver.NewServer(nopts)
	if err != nil {
		t.Fatalf("nats server: %v", err)
	}
	go ns.Start()
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats not ready")
	}

	// Redis, with the compose command line (password included).
	redisSvc := cf.Services["redis"]
	rport := m.local("redis", "6379")
	rargs := append(slices.Clone(redisSvc.Command[1:]), "--port", strconv.Itoa(rport), "--bind", "127.0.0.1", "--dir", t.TempDir())
	start(t, ctx, "redis", redisSvc.Command[0], rargs, nil)
	// As the routers connect: the ACL user and password of their config
	// and environment.
	var rcfg *config.RedisConfig
	var rpass string
	for _, n := range sortedKeys(cf.Services) {
		s := cf.Services[n]
		if binaryOf(s.Entrypoint) != "kvrouter" {
			continue
		}
		rpass = s.Environment["KVROUTER_REDIS_PASSWORD"]
		for _, v := range s.Volumes {
			if parts := strings.Split(v, ":"); len(parts) >= 2 && parts[1] == mustArg(t, s.Command, "config") {
				raw, err := os.ReadFile(filepath.Join(composeDir, parts[0]))
				if err != nil {
					t.Fatal(err)
				}
				c, err := config.ParseConfig(bytes.NewReader(raw))
				if err != nil || c.Index == nil || c.Index.Redis == nil {
					t.Fatalf("router config: %v", err)
				}
				rcfg = c.Index.Redis
			}
		}
	}
	if rcfg == nil {
		t.Fatal("no router Redis config")
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(rport), Username: rcfg.Username, Password: rpass})
	defer rdb.Close()
	waitFor(t, 15*time.Second, "redis as the routers' ACL user", func() error { return rdb.Ping(ctx).Err() })
	if err := rdb.Set(ctx, rcfg.KeyPrefix+":deploy-test", "1", time.Minute).Err(); err != nil {
		t.Errorf("the routers' user cannot write the index's keys: %v", err)
	}
	if err := rdb.Set(ctx, "elsewhere", "1", time.Minute).Err(); err == nil || !strings.Contains(err.Error(), "NOPERM") {
		t.Errorf("the routers' user wrote a key outside the index's prefix: %v", err)
	}
	// INFO's run_id is how a router tells a restarted Redis
	// (kvindex.Redis.Rewound); the rest of @dangerous stays refused.
	if err := rdb.Info(ctx, "server").Err(); err != nil {
		t.Errorf("the routers' user may not run INFO: %v", err)
	}
	if err := rdb.ConfigGet(ctx, "dir").Err(); err == nil || !strings.Contains(err.Error(), "NOPERM") {
		t.Errorf("the routers' user ran CONFIG GET: %v", err)
	}
	noAuth := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(rport)})
	if err := noAuth.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("redis answered without credentials: %v", err)
	}
	noAuth.Close()

	// Our services, engines first, as depends_on orders them.
	order := map[string]int{"kvsim": 0, "kvbridge": 1, "kvrouter": 2}
	var names []string
	for _, n := range sortedKeys(cf.Services) {
		if _, ok := order[binaryOf(cf.Services[n].Entrypoint)]; ok && len(cf.Services[n].Profiles) == 0 {
			names = append(names, n)
		}
	}
	slices.SortStableFunc(names, func(a, b string) int {
		return order[binaryOf(cf.Services[a].Entrypoint)] - order[binaryOf(cf.Services[b].Entrypoint)]
	})
	var routers []string
	for _, n := range names {
		s := cf.Services[n]
		bin := binaryOf(s.Entrypoint)
		args := m.localArgs(n, s.Command)
		env := []string{}
		for k, v := range s.Environment {
			env = append(env, k+"="+v)
		}
		if bin == "kvrouter" {
			routers = append(routers, n)
			cfgPath := mustArg(t, s.Command, "config")
			var src string
			for _, v := range s.Volumes {
				if parts := strings.Split(v, ":"); len(parts) >= 2 && parts[1] == cfgPath {
					src = parts[0]
				}
			}
			text, err := os.ReadFile(filepath.Join(composeDir, src))
			if err != nil {
				t.Fatal(err)
			}
			local := filepath.Join(t.TempDir(), "router.yaml")
			if err := os.WriteFile(local, []byte(m.localText(string(text))), 0o600); err != nil {
				t.Fatal(err)
			}
			for i, a := range args {
				if strings.HasPrefix(a, "--config=") {
					args[i] = "--config=" + local
				}
			}
		}
		start(t, ctx, n, filepath.Join(dir, bin), args, env)
	}
	if len(routers) < 2 {
		t.Fatalf("want two routers, have %v", routers)
	}

	// Both routers ready (a healthy instance each).
	client := &http.Client{Timeout: 30 * time.Second}
	for _, r := range routers {
		url := fmt.Sprintf("http://127.0.0.1:%d/readyz", m.local(r, "8080"))
		waitFor(t, 60*time.Second, r+" ready", func() error {
			resp, err := client.Get(url)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("status %d", resp.StatusCode)
			}
			return nil
		})
	}

	// The same request through both routers: served, and routed alike
	// (prefix_aware is a rendezvous hash, so replicas agree).
	prompt := strings.Repeat("You are a careful assistant for the kvrouter deployment test. ", 40)
	body := `{"model":"meta-llama/Llama-3.1-70B-Instruct","max_tokens":4,"messages":[{"role":"user","content":"` + prompt + `"}]}`
	var picked []string
	for _, r := range routers {
		resp, err := client.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", m.local(r, "8080")), "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: status %d: %s", r, resp.StatusCode, b)
		}
		picked = append(picked, resp.Header.Get("X-Kvrouter-Instance"))
	}
	if picked[0] == "" || picked[0] != picked[1] {
		t.Errorf("routers picked %v: want the same instance", picked)
	}
	// Exact routing across replicas: the engine's events went through its
	// bridge, NATS and router 1's consumer into the shared Redis index, so
	// router 2 finds the prompt's blocks there.
	waitExactRoute(t, client, fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", m.local(routers[1], "8080")), body, picked[0])

	// The engine's KV events reach JetStream under the instance's subject.
	waitStreamEvents(t, ctx, ns.ClientURL(), "llama", picked[0])

	// The admin API wants the token the compose file sets.
	adminURL := fmt.Sprintf("http://127.0.0.1:%d/admin/pools", m.local(routers[1], "8081"))
	for _, tc := range []struct {
		token string
		want  int
	}{{"", http.StatusUnauthorized}, {"wrong", http.StatusUnauthorized}, {cf.Services[routers[1]].Environment["KVROUTER_ADMIN_TOKEN"], http.StatusOK}} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, adminURL, nil)
		if tc.token != "" {
			req.Header.Set("Authorization", "Bearer "+tc.token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("admin with token %q: status %d, want %d", tc.token, resp.StatusCode, tc.want)
		}
	}
}

// jetStream connects to the NATS server at url for the rest of the test.
func jetStream(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(testenv.Connect(t, url))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// waitStreamEvents waits until JetStream holds an event of the instance
// under its subject: its engine's events went through its bridge.
func waitStreamEvents(t *testing.T, ctx context.Context, natsURL, pool, instance string) {
	t.Helper()
	js := jetStream(t, natsURL)
	subject := kvstream.SubjectEvents + "." + pool + "." + instance
	waitFor(t, 30*time.Second, "events on "+subject, func() error {
		st, err := js.Stream(ctx, kvstream.DefaultStreamName)
		if err != nil {
			return err
		}
		_, err = st.GetLastMsgForSubject(ctx, subject)
		return err
	})
}

// waitExactRoute repeats a request until the router routes it by its KV
// index (reason kv_match), and checks it goes to the instance that holds
// the prompt's blocks.
func waitExactRoute(t *testing.T, client *http.Client, url, body, holder string) {
	t.Helper()
	var last string
	waitFor(t, 30*time.Second, "a kv_match decision", func() error {
		resp, err := client.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		last = resp.Header.Get("X-Kvrouter-Reason") + " -> " + resp.Header.Get("X-Kvrouter-Instance")
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		if r := resp.Header.Get("X-Kvrouter-Reason"); r != "kv_match" {
			return fmt.Errorf("reason %q (%s)", r, resp.Header.Get("X-Kvrouter-Matched-Tokens"))
		}
		return nil
	})
	if !strings.HasSuffix(last, "-> "+holder) {
		t.Errorf("kv_match routed %s, want the instance holding the blocks, %s", last, holder)
	}
}

// start runs a process until the test ends (SIGTERM, then SIGKILL after
// 5s); its output is shown if the test fails.
func start(t *testing.T, ctx context.Context, name, bin string, args, env []string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 5 * time.Second
	out := &testenv.Logs{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("--- %s %s\n%s", name, strings.Join(args, " "), tail(out))
		}
	})
}

// waitFor polls f until it succeeds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = f(); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s: not within %v: %v", what, timeout, err)
}
