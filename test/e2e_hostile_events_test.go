package test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/fleet"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// hostileRig is a router's KV-events pipeline and server on their own NATS
// server, stream and bucket, with discovery running.
type hostileRig struct {
	t    *testing.T
	nc   *nats.Conn
	pool string
	kve  *kvstate.Pipeline
	srv  *httpapi.Server
	reg  *prometheus.Registry
	logs *testenv.Logs
}

func newHostileRig(t *testing.T, mutate func(*config.Config)) *hostileRig {
	ctx := testenv.Context(t, 2*time.Minute)
	name := testenv.UniqueName(t)
	pool := "p_" + name
	ns := testenv.StartNATS(t)
	cfg := config.Config{
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: "EV_" + name}, Bucket: "SN_" + name},
		Pools: []config.PoolConfig{{Name: pool, Model: kvrModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: "http://127.0.0.1:1"}}}},
	}
	mutate(&cfg)
	logs := &testenv.Logs{}
	log := slog.New(slog.NewJSONHandler(logs, nil))
	reg := prometheus.NewRegistry()
	kve, srv := newKVRouter(t, ctx, cfg, kvstate.Options{Logger: log, SnapshotTimeout: 200 * time.Millisecond}, reg)
	testenv.Go(t, ctx, srv.Run)
	testenv.Go(t, ctx, fleet.New(srv, kve, cfg, 50*time.Millisecond, log).Run)
	if err := kve.WaitReady(testenv.Context(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	nc := testenv.Connect(t, ns.URL())
	return &hostileRig{t: t, nc: nc, pool: pool, kve: kve, srv: srv, reg: reg, logs: logs}
}

// heartbeat publishes a heartbeat for instance announcing url, signed with
// key when sign is set (as kvbridge does with KVBRIDGE_HEARTBEAT_KEY).
func (r *hostileRig) heartbeat(instance, url string, at time.Time, key []byte, sig string) {
	r.t.Helper()
	subj, err := kvstream.InstancesSubject(r.pool, instance)
	if err != nil {
		r.t.Fatal(err)
	}
	data, _ := json.Marshal(kvstream.Heartbeat{Pool: r.pool, Instance: instance, URL: url, Model: kvrModel, Time: at, IntervalMS: 5000})
	m := &nats.Msg{Subject: subj, Data: data, Header: nats.Header{}}
	if key != nil {
		m.Header.Set(kvstream.HeaderSignature, kvstream.SignHeartbeat(key, subj, data))
	}
	if sig != "" {
		m.Header.Set(kvstream.HeaderSignature, sig)
	}
	if err := r.nc.PublishMsg(m); err != nil {
		r.t.Fatal(err)
	}
}

// counter sums the samples of a counter family whose labels include want.
func (r *hostileRig) counter(name string, want map[string]string) float64 {
	r.t.Helper()
	return testenv.Metric(r.t, r.reg, name, want)
}

// seriesWithInstance counts the series, over every family, whose instance
// label starts with prefix.
func (r *hostileRig) seriesWithInstance(prefix string) int {
	r.t.Helper()
	fams, err := r.reg.Gather()
	if err != nil {
		r.t.Fatal(err)
	}
	n := 0
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "instance" && strings.HasPrefix(l.GetValue(), prefix) {
					n++
				}
			}
		}
	}
	return n
}

func (r *hostileRig) poolInstances() map[string]string {
	p, ok := r.srv.Pool(r.pool)
	if !ok {
		r.t.Fatal("no pool")
	}
	out := map[string]string{}
	for _, in := range p.Status().Instances {
		out[in.ID] = in.URL
	}
	return out
}

func (r *hostileRig) records() map[string]bool {
	st, _ := r.kve.KVInstances(r.pool)
	out := map[string]bool{}
	for _, s := range st {
		out[s.Instance] = true
	}
	return out
}

// Discovery: with an allow-list and a heartbeat key, only a
// signed, fresh heartbeat announcing an allowed URL adds an instance
// (logged and counted as a join); a URL outside the list, an unsigned,
// a badly signed or a stale heartbeat is refused, logged and counted, and
// leaves no record.
func TestE2EDiscoveryRefusesUntrustedHeartbeats(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	r := newHostileRig(t, func(c *config.Config) {
		c.HeartbeatKey = key
		c.Pools[0].AllowedInstanceURLs = []string{"127.0.0.0/8", "http://*.vllm.internal:8000"}
	})
	now := time.Now()
	r.heartbeat("good", "http://127.0.0.1:20450", now, key, "")
	r.heartbeat("good-name", "http://a.vllm.internal:8000", now, key, "")
	r.heartbeat("outside", "http://10.9.9.9:8000", now, key, "")
	r.heartbeat("wrong-port", "http://a.vllm.internal:9000", now, key, "")
	r.heartbeat("unsigned", "http://127.0.0.1:20451", now, nil, "")
	r.heartbeat("forged", "http://127.0.0.1:20452", now, nil, "v1="+strings.Repeat("ab", 32))
	r.heartbeat("replayed", "http://127.0.0.1:20453", now.Add(-time.Hour), key, "")
	// A configured instance's heartbeat keeps it live whatever URL it
	// carries (the file's URL is the one used); it still needs the key.
	r.heartbeat("vllm-0", "http://10.1.1.1:8000", now, key, "")

	testenv.WaitFor(t, 15*time.Second, "the two trusted instances in the pool", func() bool {
		in := r.poolInstances()
		return in["good"] == "http://127.0.0.1:20450" && in["good-name"] == "http://a.vllm.internal:8000"
	})
	refused := map[string]string{"outside": "url_not_allowed", "wrong-port": "url_not_allowed", "unsigned": "unsigned",
		"forged": "bad_signature", "replayed": "stale"}
	testenv.WaitFor(t, 15*time.Second, "every refusal counted", func() bool {
		return r.counter("kvrouter_discovery_heartbeats_refused_total", map[string]string{"pool": r.pool}) == float64(len(refused))
	})
	for reason, n := range map[string]float64{"url_not_allowed": 2, "unsigned": 1, "bad_signature": 1, "stale": 1} {
		if got := r.counter("kvrouter_discovery_heartbeats_refused_total", map[string]string{"pool": r.pool, "reason": reason}); got != n {
			t.Errorf("refused for %s: %v, want %v", reason, got, n)
		}
	}
	logged := map[string]string{}
	for _, rec := range r.logs.Lines("heartbeat refused") {
		logged[rec["instance"].(string)] = rec["reason"].(string)
	}
	for name, reason := range refused {
		if logged[name] != reason {
			t.Errorf("refusal of %s logged as %q, want %q (logged: %v)", name, logged[name], reason, logged)
		}
	}
	in, recs := r.poolInstances(), r.records()
	for name := range refused {
		if _, ok := in[name]; ok || recs[name] {
			t.Errorf("refused heartbeat of %s made it into the pool or the records", name)
		}
	}
	if !recs["vllm-0"] || in["vllm-0"] != "http://127.0.0.1:1" {
		t.Errorf("the configured instance's signed heartbeat: record %v, pool URL %q", recs["vllm-0"], in["vllm-0"])
	}
	// The join is logged and counted as the pool table is published, which
	// may trail the pool's view above by a moment: wait for both.
	joined := map[string]string{}
	testenv.WaitFor(t, 15*time.Second, "both joins logged and counted", func() bool {
		clear(joined)
		for _, rec := range r.logs.Lines("instance joined pool from heartbeat") {
			joined[rec["instance"].(string)] = rec["url"].(string)
		}
		return len(joined) == 2 && r.counter("kvrouter_discovery_joins_total", map[string]string{"pool": r.pool}) == 2
	})
	if joined["good"] != "http://127.0.0.1:20450" || joined["good-name"] != "http://a.vllm.internal:8000" {
		t.Errorf("join log lines %v, want good and good-name with their URLs", joined)
	}
}

// Cardinality: 10,000 junk names on kv.events create no record
// (only configured names may start from events), 10,000 junk heartbeats
// fill at most events.max_instances records, every drop is counted, and
// once the junk goes silent its records, pool entries and series are gone.
func TestE2EJunkInstanceNamesBounded(t *testing.T) {
	const junk, maxInstances = 10000, 50
	r := newHostileRig(t, func(c *config.Config) {
		c.Events.MaxInstances = maxInstances
		c.Events.StaleAfter, c.Events.PurgeAfter = 500*time.Millisecond, 1500*time.Millisecond
	})
	payload, err := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{{Kind: events.BlockStored,
		BlockHashes: []uint64{1}, TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	for i := range junk {
		subj, _ := kvstream.EventsSubject(r.pool, fmt.Sprintf("junk-%d", i))
		if err := r.nc.Publish(subj, payload); err != nil {
			t.Fatal(err)
		}
		r.heartbeat(fmt.Sprintf("hb-%d", i), fmt.Sprintf("http://127.0.0.1:1/hb-%d", i), time.Now(), nil, "")
	}
	if err := r.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	msgs := map[string]string{"pool": r.pool, "result": "unknown_instance"}
	over := map[string]string{"pool": r.pool, "result": "over_cap"}
	testenv.WaitFor(t, 60*time.Second, "every junk message and heartbeat counted", func() bool {
		return r.counter("kvrouter_events_messages_total", msgs) == junk &&
			r.counter("kvrouter_events_heartbeats_total", over)+r.counter("kvrouter_events_heartbeats_total", map[string]string{"pool": r.pool, "result": "ok"}) >= junk
	})
	recs := r.records()
	if len(recs) > maxInstances {
		t.Fatalf("%d instance records after %d junk names, want at most %d", len(recs), 2*junk, maxInstances)
	}
	for name := range recs {
		if strings.HasPrefix(name, "junk-") {
			t.Fatalf("a name seen only on kv.events got a record: %s", name)
		}
	}
	// Every heartbeat is either admitted or counted as dropped; most are
	// dropped (a few more than junk-maxInstances are admitted when the
	// machine is slow enough for early names to be purged, freeing room:
	// the cap bounds names seen within purge_after).
	okHB := r.counter("kvrouter_events_heartbeats_total", map[string]string{"pool": r.pool, "result": "ok"})
	if got := r.counter("kvrouter_events_heartbeats_total", over); got+okHB != junk || got < junk/2 {
		t.Fatalf("heartbeats: %v dropped over the cap and %v admitted, want %d in all, most dropped", got, okHB, junk)
	}
	if n := len(r.poolInstances()); n > maxInstances+1 {
		t.Fatalf("%d pool instances, want at most %d", n, maxInstances+1)
	}
	// Per-instance series: bounded by the cap while the records live
	// (state x3, last event age, in flight, healthy; the index's own).
	if n := r.seriesWithInstance("hb-"); n > 10*maxInstances {
		t.Fatalf("%d series name junk instances, want at most %d", n, 10*maxInstances)
	}
	if n := r.seriesWithInstance("junk-"); n != 0 {
		t.Fatalf("%d series name instances seen only in events", n)
	}
	if logged := r.logs.Lines("consumer: instance refused a record"); len(logged) == 0 || len(logged) > 20 {
		t.Fatalf("%d log lines for %d refused names, want a few (rate-limited)", len(logged), 2*junk)
	}
	// Silent junk is purged and forgotten: records, pool entries, series.
	testenv.WaitFor(t, 30*time.Second, "junk purged and forgotten", func() bool {
		return len(r.records()) == 0 && len(r.poolInstances()) == 1 && r.seriesWithInstance("hb-") == 0
	})
}

// A bridge given a heartbeat key signs every heartbeat so that a router
// holding the same key verifies it, and one holding another key does not.
func TestE2EBridgeSignsHeartbeats(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	r := newRig(t, rigOpts{heartbeatKey: key})
	subj, _ := kvstream.PoolSubjects(kvstream.SubjectInstances, r.pool)
	sub, err := r.conn().SubscribeSync(subj)
	if err != nil {
		t.Fatal(err)
	}
	m, err := sub.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := kvstream.VerifyHeartbeat(key, m.Subject, m.Data, m.Header); err != nil {
		t.Fatalf("the bridge's heartbeat does not verify with its key: %v", err)
	}
	if err := kvstream.VerifyHeartbeat([]byte("another key, 32 bytes long......"), m.Subject, m.Data, m.Header); err == nil {
		t.Fatal("the bridge's heartbeat verifies with another key")
	}
}

// readyRig starts a router whose pool has a snapshot in the bucket for
// vllm-0, served by a "bridge" that answers snapshot requests after delay.
func readyRig(t *testing.T, delay, readyTimeout time.Duration) (readyz string, blocks func() int, logs *testenv.Logs) {
	ctx := testenv.Context(t, time.Minute)
	name := testenv.UniqueName(t)
	pool := "p_" + name
	ns := testenv.StartNATS(t)
	nc := testenv.Connect(t, ns.URL())
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := kvstream.EnsureBucket(ctx, js, kvstream.BucketConfig{Name: "SN_" + name})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := events.Encode(nil, events.Batch{Events: []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{4242},
		TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}}, events.EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := kvstream.Snapshot{Pool: pool, Instance: "vllm-0", Blocks: 1, Batch: batch, Taken: time.Now()}.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	key, _ := kvstream.SnapshotKey(pool, "vllm-0")
	if _, err := kv.Put(ctx, key, snap); err != nil {
		t.Fatal(err)
	}
	subj, _ := kvstream.SnapshotSubject(pool, "vllm-0")
	sub, err := nc.Subscribe(subj, func(m *nats.Msg) {
		time.Sleep(delay)
		_ = m.Respond(snap)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	up := routertest.New(t, "vllm-0", kvrModel)
	cfg := config.Config{
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: "EV_" + name}, Bucket: "SN_" + name, ReadyTimeout: readyTimeout},
		Pools: []config.PoolConfig{{Name: pool, Model: kvrModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: up.URL()}}}},
	}
	logs = &testenv.Logs{}
	log := slog.New(slog.NewJSONHandler(logs, nil))
	kve, srv := newKVRouter(t, ctx, cfg, kvstate.Options{Logger: log, SnapshotTimeout: 10 * time.Second}, nil)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	idx, _ := kve.KV(cfg.Pools[0])
	blocks = func() int {
		st, err := idx.Instances(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, s := range st {
			n += s.Blocks[0]
		}
		return n
	}
	return ts.URL + "/readyz", blocks, logs
}

// pollReady polls url until it answers 200, returning how many 503s came
// first and the last 503's body.
func pollReady(t *testing.T, url string, within time.Duration) (notReady int, why string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		res := httpDo(t, http.MethodGet, url, "", nil)
		switch res.status {
		case http.StatusOK:
			return notReady, why
		case http.StatusServiceUnavailable:
			notReady, why = notReady+1, res.body
		default:
			t.Fatalf("/readyz answered %d: %s", res.status, res.body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("/readyz not ready within %v (last: %s)", within, why)
	return 0, ""
}

// Readiness: /readyz says ready only once the index has been rebuilt (here:
// a snapshot that takes 1.5 s to arrive is in the index when it first
// answers 200), or once events.ready_timeout has passed.
func TestE2EReadyzWaitsForTheIndex(t *testing.T) {
	t.Run("rebuilt", func(t *testing.T) {
		url, blocks, _ := readyRig(t, 1500*time.Millisecond, time.Minute)
		n, why := pollReady(t, url, 30*time.Second)
		if got := blocks(); got != 1 {
			t.Fatalf("ready with %d blocks in the index, want the snapshot's 1", got)
		}
		if n == 0 || !strings.Contains(why, "being rebuilt") {
			t.Fatalf("%d not-ready answers before ready (last %q): want 503s while the snapshot loads", n, why)
		}
	})
	t.Run("timeout", func(t *testing.T) {
		url, blocks, logs := readyRig(t, 8*time.Second, 300*time.Millisecond)
		pollReady(t, url, 6*time.Second)
		if got := blocks(); got != 0 {
			t.Fatalf("the snapshot (8 s away) is already in the index (%d blocks): the timeout was not what made it ready", got)
		}
		if len(logs.Lines("KV index not rebuilt within events.ready_timeout; reporting ready, kv_aware routes heuristically until the stream is healthy")) != 1 {
			t.Fatal("readiness by timeout not logged once")
		}
	})
}
