package config

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"
)

func TestExampleConfigLoads(t *testing.T) {
	cfg, err := LoadConfig("../examples/router.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	cfg = cfg.WithDefaults()
	p := cfg.Pools[0]
	if cfg.Listen != "127.0.0.1:8080" || cfg.AdminListen != "127.0.0.1:8081" || p.Name != "llama" || p.Routing.Strategy != "prefix_aware" ||
		p.Routing.PrefixLength != 8192 || p.Routing.ConcurrencyThreshold != 64 || p.Instances[0].URL != "http://127.0.0.1:8001" {
		t.Fatalf("example config read as %+v", cfg)
	}
}

func TestIssueConfigShape(t *testing.T) {
	const doc = `
listen: ":8080"
admin_listen: ":8081"            # admin API and /metrics; omit to serve them on listen
pools:
  - name: llama
    model: meta-llama/Llama-3.1-70B-Instruct   # requests pick a pool by their "model"
    routing:
      strategy: prefix_aware      # random | round_robin | least_outstanding | prefix_aware
      prefix_length: 8192         # 1024..65536
      concurrency_threshold: 64   # 1..1024
    instances:
      - id: vllm-0
        url: http://127.0.0.1:8001
`
	cfg, err := ParseConfig(strings.NewReader(doc))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestConfigDefaults(t *testing.T) {
	cfg, err := ParseConfig(strings.NewReader("pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}]"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	c := cfg.WithDefaults()
	p := c.Pools[0]
	checks := []struct {
		name      string
		got, want any
	}{
		{"listen", c.Listen, ":8080"},
		{"max_body_bytes", c.MaxBodyBytes, int64(32 << 20)},
		{"strategy", p.Routing.Strategy, "prefix_aware"},
		{"prefix_length", p.Routing.PrefixLength, 8192},
		{"concurrency_threshold", p.Routing.ConcurrencyThreshold, 64},
		{"health.path", p.Health.Path, "/health"},
		{"health.interval", p.Health.Interval, 5 * time.Second},
		{"health.unhealthy_threshold", p.Health.UnhealthyThreshold, 3},
		{"health.healthy_threshold", p.Health.HealthyThreshold, 2},
		{"invoke_path", p.InvokePath, "/invocations"},
		{"adapter_fallback", p.AdapterFallback, "none"},
		{"retry_statuses", len(c.Proxy.RetryStatuses), 3},
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s = %v, want %v", ch.name, ch.got, ch.want)
		}
	}
}

func TestConfigRejects(t *testing.T) {
	base := "pools: [{name: p, model: m, %s instances: [{id: a, url: 'http://h:1'}]}]"
	tests := []struct {
		name, doc, want string
	}{
		{"typo", "listn: ':1'\n" + strings.Replace(base, "%s", "", 1), `listn: unknown field (did you mean "listen"?)`},
		{"typo in pool", strings.Replace(base, "%s", "routng: {strategy: random},", 1), `pools[0].routng: unknown field (did you mean "routing"?)`},
		{"no pools", "listen: ':1'", "pools: at least one pool"},
		{"prefix too small", strings.Replace(base, "%s", "routing: {prefix_length: 1000},", 1), "pools[0].routing.prefix_length 1000 out of range 1024..65536"},
		{"prefix too big", strings.Replace(base, "%s", "routing: {prefix_length: 65537},", 1), "pools[0].routing.prefix_length 65537 out of range"},
		{"threshold", strings.Replace(base, "%s", "routing: {concurrency_threshold: 1025},", 1), "pools[0].routing.concurrency_threshold 1025 out of range 1..1024"},
		{"strategy", strings.Replace(base, "%s", "routing: {strategy: fastest},", 1), `pools[0].routing.strategy "fastest": want one of random, round_robin, least_outstanding, prefix_aware`},
		{"fallback", strings.Replace(base, "%s", "adapter_fallback: some,", 1), `pools[0].adapter_fallback "some"`},
		{"health interval", strings.Replace(base, "%s", "health: {interval: 1ms},", 1), "pools[0].health.interval 1ms out of range"},
		{"bad url", "pools: [{name: p, model: m, instances: [{id: a, url: 'h:1'}]}]", `pools[0].instances[0].url "h:1"`},
		{"dup instance", "pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}, {id: a, url: 'http://h:2'}]}]", "duplicate instance id"},
		{"dup pool", "pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}, {name: p, model: n, instances: [{id: a, url: 'http://h:1'}]}]", "duplicate pool name"},
		{"dup model", "pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}, {name: q, model: m, instances: [{id: a, url: 'http://h:1'}]}]", "already served by pool"},
		{"bad name", "pools: [{name: 'a b', model: m, instances: [{id: a, url: 'http://h:1'}]}]", `pools[0].name "a b"`},
		{"no instances", "pools: [{name: p, model: m}]", "pools[0].instances: at least one"},
		{"body limit", "max_body_bytes: 10\n" + strings.Replace(base, "%s", "", 1), "max_body_bytes 10 out of range"},
		{"log level", "log: {level: loud}\n" + strings.Replace(base, "%s", "", 1), `log.level "loud"`},
		{"default pool", "default_pool: x\n" + strings.Replace(base, "%s", "", 1), `default_pool "x": no such pool`},
		{"index backend", "index: {backend: etcd}\n" + strings.Replace(base, "%s", "", 1), `index.backend "etcd"`},
		{"redis without addrs", "index: {backend: redis}\n" + strings.Replace(base, "%s", "", 1), "index.redis.addrs"},
		{"retry status", "proxy: {retry_statuses: [200]}\n" + strings.Replace(base, "%s", "", 1), "proxy.retry_statuses[0] 200"},
		{"admin on the data port", "listen: ':8080'\nadmin_listen: ':8080'\n" + strings.Replace(base, "%s", "", 1), `admin_listen ":8080" is the same address as listen ":8080": leave admin_listen empty`},
		{"admin on every interface of the data port", "listen: '127.0.0.1:8080'\nadmin_listen: '0.0.0.0:8080'\n" + strings.Replace(base, "%s", "", 1), `admin_listen "0.0.0.0:8080" is the same address as listen`},
		{"grpc on the admin port", "admin_listen: '127.0.0.1:8081'\ngrpc: {listen: '127.0.0.1:8081'}\n" + strings.Replace(base, "%s", "", 1), `grpc.listen "127.0.0.1:8081" is the same address as admin_listen`},
		{"token in file", "admin_token: x\n" + strings.Replace(base, "%s", "", 1), "admin_token: unknown field"},
		{"sync min_gap too small", "events: {nats: {url: 'nats://h:4222'}, replica_sync: {enabled: true, min_gap: 10us}}\n" + strings.Replace(base, "%s", "", 1), "events.replica_sync.min_gap 10µs out of range 100µs..interval (50ms)"},
		{"sync min_gap over interval", "events: {nats: {url: 'nats://h:4222'}, replica_sync: {enabled: true, interval: 5ms, min_gap: 6ms}}\n" + strings.Replace(base, "%s", "", 1), "events.replica_sync.min_gap 6ms out of range 100µs..interval (5ms)"},
		{"tokenizer source", strings.Replace(base, "%s", "tokenizer: {source: magic},", 1), `tokenizer.source "magic"`},
		// With KV events a pool name and an instance id are NATS subject
		// tokens (kv.events.<pool>.<instance>): a dot can never match a
		// bridge (kvbridge refuses it), so the instance's blocks would
		// silently never count.
		{"dot in instance id with events", "index: {backend: memory}\npools: [{name: p, model: m, instances: [{id: vllm.1, url: 'http://h:1'}]}]",
			`pools[0].instances[0].id "vllm.1": '.' cannot be used with KV events`},
		{"dot in pool name with events", "pools: [{name: p.x, model: m, routing: {strategy: kv_aware}, instances: [{id: a, url: 'http://h:1'}]}]",
			`pools[0].name "p.x": '.' cannot be used with KV events`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := ParseConfig(strings.NewReader(tc.doc))
			if err == nil {
				err = cfg.Validate()
			}
			if err == nil || !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want ErrInvalidConfig mentioning %q", err, tc.want)
			}
		})
	}
}

func TestConfigReservedSectionsParse(t *testing.T) {
	doc := `
index: {backend: redis, capacity: 1000000, redis: {addrs: ["127.0.0.1:6379"], key_prefix: kv, ttl: 10m}}
events: {nats: {url: "nats://127.0.0.1:4222", creds_file: /etc/nats.creds, embedded: false, tls: {ca_file: /ca.pem}}}
pools:
  - name: p
    model: m
    tokenizer: {source: files, path: /models/llama}
    routing: {strategy: prefix_aware, kv: {prefill_tokens_per_second: 10000, cpu_load_tokens_per_second: 50000, block_size: 16}}
    instances: [{id: a, url: 'http://h:1', adapters: [x]}]
`
	cfg, err := ParseConfig(strings.NewReader(doc))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.Index.Redis.TTL != 10*time.Minute || cfg.Events.NATS.TLS.CAFile != "/ca.pem" || cfg.Pools[0].Routing.KV.BlockSize != 16 {
		t.Fatalf("reserved sections read as %+v %+v", cfg.Index, cfg.Events)
	}
}

func TestLoadConfigErrors(t *testing.T) {
	if _, err := LoadConfig("/nonexistent/router.yaml"); err == nil || !os.IsNotExist(errors.Unwrap(err)) {
		t.Fatalf("missing file: %v", err)
	}
	f := t.TempDir() + "/bad.yaml"
	os.WriteFile(f, []byte("pools: [\n"), 0o600)
	if _, err := LoadConfig(f); err == nil || !strings.Contains(err.Error(), f) {
		t.Fatalf("bad yaml: %v", err)
	}
}

// TestConfigErrorsNameYAMLPaths: decoding errors speak the file's language —
// the YAML path of the key, the known field a typo meant, how to write a
// duration — not Go type names.
func TestConfigErrorsNameYAMLPaths(t *testing.T) {
	tests := []struct {
		name, doc string
		want      []string
		not       string
	}{
		{"typo in routing", "pools:\n  - name: p\n    routing:\n      concurency_threshold: 3\n",
			[]string{`line 4: pools[0].routing.concurency_threshold: unknown field (did you mean "concurrency_threshold"?)`}, "router.RoutingConfig"},
		{"typo in a pool", "pools:\n  - name: p\n    model: m\n    instances: [{id: a, url: 'http://h:1'}]\n    helth: {interval: 5s}\n",
			[]string{`line 5: pools[0].helth: unknown field (did you mean "health"?)`}, "router.PoolConfig"},
		{"far from any field", "pools: [{name: p,\n  colour: blue}]\n",
			[]string{"line 2: pools[0].colour: unknown field"}, "did you mean"},
		{"duration without unit", "pools:\n  - name: p\n    model: m\n    instances: [{id: a, url: 'http://h:1'}]\n    health: {interval: 5}\n",
			[]string{`line 5: pools[0].health.interval: "5" is not a duration: write a number with a unit, e.g. "5s" or "250ms"`}, "!!int"},
		{"wrong kind", "max_body_bytes: lots\n",
			[]string{`line 1: max_body_bytes: cannot use str "lots" here (want an integer)`}, "int64"},
		{"secret in file", "admin_token: x\n", []string{"line 1: admin_token: unknown field"}, "router.Config"},
		{"two errors", "pools:\n  - routing:\n      strategyy: random\nlistenn: x\n",
			[]string{`line 3: pools[0].routing.strategyy: unknown field (did you mean "strategy"?)`, `line 4: listenn: unknown field (did you mean "listen"?)`}, "type"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseConfig(strings.NewReader(tc.doc))
			if err == nil || !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("err %v, want ErrInvalidConfig", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("err %q\nwant it to say %q", err, w)
				}
			}
			if strings.Contains(err.Error(), tc.not) {
				t.Errorf("err %q still says %q", err, tc.not)
			}
		})
	}
}

func TestClosestField(t *testing.T) {
	known := []string{"listen", "admin_listen", "pools", "routing", "max_body_bytes"}
	for got, want := range map[string]string{
		"listn": "listen", "pool": "pools", "routng": "routing", "max_body_byte": "max_body_bytes", "lsiten": "listen",
		"x": "", "logging": "", "": "",
	} {
		if s := closestField(known, got); s != want {
			t.Errorf("closestField(%q) = %q, want %q", got, s, want)
		}
	}
}

func TestSameListenAddr(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want bool
	}{
		{":8080", ":8080", true}, {":8080", "127.0.0.1:8080", true}, {"0.0.0.0:9", "[::1]:9", true},
		{"127.0.0.1:8080", "127.0.0.1:8081", false}, {"127.0.0.1:8080", "10.0.0.1:8080", false},
		{":0", ":0", false}, {"[::1]:8080", "[::1]:8080", true},
	} {
		if got := sameListenAddr(tc.a, tc.b); got != tc.want {
			t.Errorf("sameListenAddr(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
}

// TestJetStreamNames: a stream or bucket name the NATS server would refuse
// is refused at load, naming the key (with it the router would start,
// consume nothing and route every kv_aware decision as stream_down).
func TestJetStreamNames(t *testing.T) {
	const pool = "pools:\n  - name: p\n    model: m\n    instances: [{id: a, url: 'http://h:1'}]\n"
	for _, tc := range []struct {
		stream, bucket string
		bad            string // the key the error names; "" = accepted
	}{
		{"KV_EVENTS", "KV_SNAPSHOTS", ""},
		{"EV_t1_2_replicas=2-sync=true", "SN_x", ""},
		{"EV_replicas=2/sync=true", "", "events.nats.stream"},
		{"a.b", "", "events.nats.stream"},
		{"a b", "", "events.nats.stream"},
		{"a>", "", "events.nats.stream"},
		{`a\b`, "", "events.nats.stream"},
		{strings.Repeat("s", 256), "", "events.nats.stream"},
		{"", "snap*", "events.bucket"},
		{"", "x/y", "events.bucket"},
	} {
		doc := pool + "events:\n  nats: {stream: '" + tc.stream + "'}\n  bucket: '" + tc.bucket + "'\n"
		c, err := ParseConfig(strings.NewReader(doc))
		if err != nil {
			t.Fatalf("parse: %v", err)
		}
		err = c.Validate()
		if tc.bad == "" {
			if err != nil {
				t.Errorf("stream %q bucket %q: %v", tc.stream, tc.bucket, err)
			}
			continue
		}
		if err == nil || !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.bad+" ") {
			t.Errorf("stream %.20q bucket %q: err %v, want ErrInvalidConfig naming %s", tc.stream, tc.bucket, err, tc.bad)
		}
	}
}

// Without KV events a dot stays a valid name (nothing is a NATS subject).
func TestConfigDotsWithoutEvents(t *testing.T) {
	cfg, err := ParseConfig(strings.NewReader("pools: [{name: p.x, model: m, instances: [{id: vllm.1, url: 'http://h:1'}]}]"))
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		t.Fatal(err)
	}
}
