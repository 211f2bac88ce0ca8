package consumer

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// recorder is an Applier that records, per instance, the first block hash
// of every stored event (dropped again by a BlockRemoved of it, and all by
// an AllBlocksCleared), and purges.
type recorder struct {
	mu     sync.Mutex // guards stored and purges
	stored map[string][]uint64
	purges map[string]int
}

func newRecorder() *recorder {
	return &recorder{stored: map[string][]uint64{}, purges: map[string]int{}}
}

func (r *recorder) Apply(_ context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range evs {
		switch {
		case e.Kind == events.BlockStored && len(e.BlockHashes) > 0:
			r.stored[instance] = append(r.stored[instance], e.BlockHashes[0])
		case e.Kind == events.BlockRemoved:
			r.stored[instance] = slices.DeleteFunc(r.stored[instance], func(h uint64) bool { return slices.Contains(e.BlockHashes, h) })
		case e.Kind == events.AllBlocksCleared:
			delete(r.stored, instance)
		}
	}
	return kvindex.ApplyResult{}, nil
}

func (r *recorder) Purge(_ context.Context, instance string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.purges[instance]++
	delete(r.stored, instance)
	return nil
}

func (r *recorder) get(instance string) ([]uint64, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]uint64(nil), r.stored[instance]...), r.purges[instance]
}

type env struct {
	t    *testing.T
	ctx  context.Context
	nc   *nats.Conn
	js   jetstream.JetStream
	pool string
	cfg  Config
}

func newEnv(t *testing.T) *env {
	ctx := testenv.Context(t, time.Minute)
	nc := testenv.Connect(t, testenv.NATSURL(t))
	js, _ := jetstream.New(nc)
	name := testenv.UniqueName(t)
	e := &env{t: t, ctx: ctx, nc: nc, js: js, pool: "p_" + name}
	e.cfg = Config{Conn: nc, Pool: e.pool, Stream: kvstream.StreamConfig{Name: "S_" + name, Memory: true},
		Bucket: kvstream.BucketConfig{Name: "B_" + name, Memory: true}, Logger: slog.New(slog.DiscardHandler)}
	if _, err := kvstream.EnsureStream(ctx, js, e.cfg.Stream); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) start(cfg Config) *Consumer {
	e.t.Helper()
	c, err := New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	testenv.Go(e.t, e.ctx, c.Run)
	testenv.WaitFor(e.t, 10*time.Second, "consumer healthy", c.Healthy)
	return c
}

// store publishes a one-block BlockStored batch straight into the stream.
func (e *env) store(instance string, seq uint64, hash uint64) {
	e.t.Helper()
	e.send(instance, seq, storedBlock(hash))
}

// storedBlock is an event storing the one 16-token block hash.
func storedBlock(hash uint64) events.Event {
	return events.Event{Kind: events.BlockStored, BlockHashes: []uint64{hash}, TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}
}

// send publishes a batch of evs, engine seq seq, straight into the stream.
func (e *env) send(instance string, seq uint64, evs ...events.Event) {
	e.t.Helper()
	p, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: evs}, events.EncodingMap)
	if err != nil {
		e.t.Fatal(err)
	}
	subj, _ := kvstream.EventsSubject(e.pool, instance)
	h := kvstream.EventHeaders{Seq: seq, HasSeq: true, Pool: e.pool, Instance: instance}
	if _, err := e.js.PublishMsg(e.ctx, &nats.Msg{Subject: subj, Data: p, Header: h.Header()}); err != nil {
		e.t.Fatal(err)
	}
}

// startRecording starts a consumer with the default config applying into
// a new recorder.
func (e *env) startRecording() (*Consumer, *recorder) {
	e.t.Helper()
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier = a
	return e.start(cfg), a
}

// putSnapshotBytes stores data as instance's snapshot in the pool's bucket.
func (e *env) putSnapshotBytes(instance string, data []byte) {
	e.t.Helper()
	kv, err := kvstream.EnsureBucket(e.ctx, e.js, e.cfg.Bucket)
	if err != nil {
		e.t.Fatal(err)
	}
	key, _ := kvstream.SnapshotKey(e.pool, instance)
	if _, err := kv.Put(e.ctx, key, data); err != nil {
		e.t.Fatal(err)
	}
}

// oneBlockSnapshot is instance's snapshot holding one stored block.
func (e *env) oneBlockSnapshot(instance string, hash uint64) []byte {
	batch, _ := events.Encode(nil, events.Batch{Events: []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{hash},
		TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}}, events.EncodingMap)
	snap, _ := kvstream.Snapshot{Pool: e.pool, Instance: instance, Blocks: 1, Batch: batch}.MarshalBinary()
	return snap
}

func (e *env) heartbeat(instance string) {
	subj, _ := kvstream.InstancesSubject(e.pool, instance)
	b, _ := json.Marshal(kvstream.Heartbeat{Pool: e.pool, Instance: instance, URL: "http://" + instance, BlockSize: 16, Time: time.Now()})
	_ = e.nc.Publish(subj, b)
}

func TestConfigValidation(t *testing.T) {
	nc := &nats.Conn{}
	a := newRecorder()
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no conn", Config{Pool: "p", Applier: a}, "no NATS"},
		{"no applier", Config{Conn: nc, Pool: "p"}, "no applier"},
		{"bad pool", Config{Conn: nc, Pool: "a.b", Applier: a}, "invalid subject token"},
		{"purge before stale", Config{Conn: nc, Pool: "p", Applier: a, StaleAfter: time.Minute, PurgeAfter: time.Second}, "shorter"},
		{"negative", Config{Conn: nc, Pool: "p", Applier: a, Shards: -1}, "negative"},
		{"negative lag", Config{Conn: nc, Pool: "p", Applier: a, MaxLag: -time.Second}, "negative"},
	}
	for _, tc := range tests {
		if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", tc.name, err, tc.want)
		}
	}
}

// Each instance's events apply in stream order, whatever the interleaving
// and the number of shards.
func TestPerInstanceOrder(t *testing.T) {
	e := newEnv(t)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.Shards = a, 3
	c := e.start(cfg)
	const instances, per = 8, 40
	for i := 0; i < per; i++ {
		for in := 0; in < instances; in++ {
			e.store(fmt.Sprintf("i%d", in), uint64(i+1), uint64(i+1))
		}
	}
	for in := 0; in < instances; in++ {
		name := fmt.Sprintf("i%d", in)
		testenv.WaitFor(t, 20*time.Second, name+" applied", func() bool { s, _ := a.get(name); return len(s) == per })
		s, _ := a.get(name)
		for i, h := range s {
			if h != uint64(i+1) {
				t.Fatalf("%s: event %d has hash %d: out of order", name, i, h)
			}
		}
	}
	if n := len(c.Instances()); n != instances {
		t.Fatalf("%d instances", n)
	}
	// Far behind the stream is not healthy.
	if !c.Healthy() {
		t.Fatal("caught-up consumer unhealthy")
	}
	c.lag.Store(int64(time.Minute))
	if c.Healthy() {
		t.Fatal("a consumer a minute behind reports healthy")
	}
}

// An engine seq already applied comes again (a message stored twice, or
// one stored after a later one): it is not applied again, and the
// messages after it are.
func TestDuplicateSeqSkipped(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.store("i0", 1, 11)
	e.store("i0", 2, 12)
	e.store("i0", 1, 11) // again
	e.store("i0", 2, 99) // a seq applied, whatever its payload
	e.store("i0", 3, 13)
	testenv.WaitFor(t, 20*time.Second, "seq 3 applied", func() bool {
		for _, s := range c.Instances() {
			if s.Instance == "i0" && s.LastSeq == 3 {
				return true
			}
		}
		return false
	})
	if got, _ := a.get("i0"); !slices.Equal(got, []uint64{11, 12, 13}) {
		t.Fatalf("applied stores %v, want [11 12 13]", got)
	}
	if n := counterValue(c.m.messages.WithLabelValues("duplicate_seq")); n != 2 {
		t.Fatalf("%v messages counted duplicate_seq, want 2", n)
	}
	for _, s := range c.Instances() {
		if s.Instance == "i0" && s.Gaps != 0 {
			t.Fatalf("a repeated seq counted as a gap: %+v", s)
		}
	}
}

// Heartbeats discover an instance; silence makes it stale, then purged;
// a heartbeat brings it back.
func TestStaleAndPurge(t *testing.T) {
	e := newEnv(t)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.StaleAfter, cfg.PurgeAfter, cfg.CheckInterval = a, 300*time.Millisecond, 900*time.Millisecond, 20*time.Millisecond
	c := e.start(cfg)
	state := func() State {
		for _, s := range c.Instances() {
			if s.Instance == "vllm-0" {
				return s.State
			}
		}
		return 0
	}
	e.heartbeat("vllm-0")
	testenv.WaitFor(t, 5*time.Second, "discovery", func() bool { return state() == StateLive && c.Live("vllm-0") })
	e.store("vllm-0", 1, 42)
	testenv.WaitFor(t, 5*time.Second, "event applied", func() bool { s, _ := a.get("vllm-0"); return len(s) == 1 })
	if hb := c.Instances()[0].Heartbeat; hb == nil || hb.URL != "http://vllm-0" {
		t.Fatalf("heartbeat %+v", hb)
	}
	testenv.WaitFor(t, 5*time.Second, "stale", func() bool { return state() == StateStale })
	if c.Live("vllm-0") {
		t.Fatal("stale instance reported live")
	}
	if _, purges := a.get("vllm-0"); purges != 0 {
		t.Fatal("purged while only stale")
	}
	// Purged, then forgotten: no record is left to list or export.
	testenv.WaitFor(t, 5*time.Second, "purged and forgotten", func() bool { _, p := a.get("vllm-0"); return state() == 0 && p == 1 })
	e.heartbeat("vllm-0")
	testenv.WaitFor(t, 5*time.Second, "back to live", func() bool { return state() == StateLive })
	if c.Live("unknown") {
		t.Fatal("unknown instance reported live")
	}
}

// With a shared index the consumer only keeps up: no purge, no snapshot,
// no history.
func TestSharedIndex(t *testing.T) {
	e := newEnv(t)
	e.store("i0", 1, 1) // before the consumer starts: not replayed
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.SharedIndex = a, true
	e.start(cfg)
	e.store("i0", 2, 2)
	testenv.WaitFor(t, 5*time.Second, "new event", func() bool { s, _ := a.get("i0"); return len(s) == 1 })
	if s, p := a.get("i0"); s[0] != 2 || p != 0 {
		t.Fatalf("stored %v purges %d", s, p)
	}
}

// BenchmarkLive is the router's per-candidate staleness check.
func BenchmarkLive(b *testing.B) {
	c := &Consumer{insts: map[string]*inst{}}
	for i := 0; i < 64; i++ {
		name := fmt.Sprintf("vllm-%d", i)
		c.insts[name] = &inst{status: InstanceStatus{Instance: name, State: StateLive}}
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !c.Live("vllm-7") {
				b.Fatal("not live")
			}
		}
	})
}

// failOnce fails the first Apply that stores the given hash.
type failOnce struct {
	*recorder
	hash   uint64
	failed bool
}

func (f *failOnce) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	for _, e := range evs {
		if !f.failed && len(e.BlockHashes) > 0 && e.BlockHashes[0] == f.hash {
			f.failed = true
			return kvindex.ApplyResult{}, fmt.Errorf("index unreachable")
		}
	}
	return f.recorder.Apply(ctx, instance, evs)
}

// After a failed Apply the instance reloads its snapshot (here from the
// bucket: no bridge answers) before applying further events.
func TestApplyFailureReloadsSnapshot(t *testing.T) {
	e := newEnv(t)
	e.putSnapshotBytes("i0", e.oneBlockSnapshot("i0", 100))
	a := &failOnce{recorder: newRecorder(), hash: 1}
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	e.start(cfg)
	e.store("i0", 1, 1) // fails
	e.store("i0", 2, 2)
	testenv.WaitFor(t, 10*time.Second, "event 2", func() bool { s, _ := a.get("i0"); return len(s) > 0 && s[len(s)-1] == 2 })
	s, purges := a.get("i0")
	// Start-up load (snapshot), then after the failure a reload (purge +
	// snapshot), then the replay of event 1 (after the snapshot's stream
	// position, and this time applied), before event 2.
	if purges != 2 || !slices.Equal(s, []uint64{100, 1, 2}) {
		t.Fatalf("stored %v after %d purges", s, purges)
	}
}

// Replaying stream history does not make an instance that went silent
// long ago look live: it is judged by its events' store times, and once
// purged its old events are not applied again.
func TestHistoryOfDeadInstance(t *testing.T) {
	e := newEnv(t)
	e.store("old", 1, 1)
	e.store("old", 2, 2)
	time.Sleep(700 * time.Millisecond)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.StaleAfter, cfg.PurgeAfter, cfg.CheckInterval = a, 200*time.Millisecond, 500*time.Millisecond, 20*time.Millisecond
	c := e.start(cfg)
	e.store("new", 1, 7)
	testenv.WaitFor(t, 5*time.Second, "new applied", func() bool { s, _ := a.get("new"); return len(s) == 1 })
	if !c.Live("new") {
		t.Fatal("fresh instance not live")
	}
	if c.Live("old") {
		t.Fatal("instance silent for 700ms (stale after 200ms) reported live")
	}
	testenv.WaitFor(t, 5*time.Second, "old purged and forgotten", func() bool {
		_, purges := a.get("old")
		for _, s := range c.Instances() {
			if s.Instance == "old" {
				return false
			}
		}
		return purges > 0
	})
}

// Names seen only in events get no record unless admitted; heartbeats
// create records up to the cap; a refused heartbeat creates nothing; every
// drop is counted.
func TestJunkNamesBounded(t *testing.T) {
	e := newEnv(t)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.MaxInstances = a, 5
	cfg.Admit = func(name string) bool { return name == "vllm-0" }
	cfg.AdmitHeartbeat = func(name string, _ *nats.Msg, _ *kvstream.Heartbeat) error {
		if strings.HasPrefix(name, "bad-") {
			return fmt.Errorf("refused")
		}
		return nil
	}
	c := e.start(cfg)
	for i := range 200 {
		e.store(fmt.Sprintf("junk-%d", i), 1, uint64(i))
	}
	e.store("vllm-0", 1, 7)
	testenv.WaitFor(t, 10*time.Second, "the admitted instance's event", func() bool { s, _ := a.get("vllm-0"); return len(s) == 1 })
	testenv.WaitFor(t, 10*time.Second, "junk events counted", func() bool {
		return counterValue(c.m.messages.WithLabelValues("unknown_instance")) == 200
	})
	for i := range 10 {
		e.heartbeat(fmt.Sprintf("hb-%d", i))
	}
	e.heartbeat("bad-0")
	testenv.WaitFor(t, 10*time.Second, "heartbeats counted", func() bool {
		return counterValue(c.m.heartbeats.WithLabelValues("over_cap")) == 6 &&
			counterValue(c.m.heartbeats.WithLabelValues("refused")) == 1
	})
	names := map[string]bool{}
	for _, s := range c.Instances() {
		names[s.Instance] = true
	}
	if len(names) != 5 || !names["vllm-0"] || names["bad-0"] {
		t.Fatalf("records %v: want vllm-0 and 4 heartbeat names, capped at 5", names)
	}
	for name := range names {
		if strings.HasPrefix(name, "junk-") {
			t.Fatalf("a name seen only in events got a record: %s", name)
		}
	}
	if s, _ := a.get("junk-0"); len(s) != 0 {
		t.Fatal("a junk name's events reached the index")
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// A heartbeat saying the engine is down makes the instance not live at
// once, and events still arriving do not make it live again; the next
// heartbeat without it makes it live only after the bridge's table was
// reloaded.
func TestEngineDownHeartbeat(t *testing.T) {
	e := newEnv(t)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.CheckInterval = a, 20*time.Millisecond
	c := e.start(cfg)
	hb := func(down bool) {
		subj, _ := kvstream.InstancesSubject(e.pool, "i0")
		b, _ := json.Marshal(kvstream.Heartbeat{Pool: e.pool, Instance: "i0", EngineDown: down, Time: time.Now()})
		if err := e.nc.Publish(subj, b); err != nil {
			t.Fatal(err)
		}
	}
	hb(false)
	e.store("i0", 1, 1)
	testenv.WaitFor(t, 10*time.Second, "live", func() bool { return c.Live("i0") })

	hb(true)
	testenv.WaitFor(t, 10*time.Second, "not live while the engine is down", func() bool {
		st := c.Instances()
		return !c.Live("i0") && len(st) == 1 && st[0].EngineDown
	})
	e.store("i0", 2, 2) // late events of the dead engine
	testenv.WaitFor(t, 10*time.Second, "late event applied", func() bool { s, _ := a.get("i0"); return len(s) == 2 })
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if c.Live("i0") {
			t.Fatal("an event made an instance whose engine is down live")
		}
	}

	hb(false)
	testenv.WaitFor(t, 10*time.Second, "live again after the reload", func() bool {
		st := c.Instances()
		return c.Live("i0") && !st[0].EngineDown
	})
}

// An event the codec cannot read (here a BlockStored whose medium is an
// integer) is skipped and counted; the stores beside it in its batch apply.
func TestUnreadableEventCounted(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	stored := func(hash uint64, medium []byte) []byte {
		p := []byte{0x97, 0xab}
		p = append(p, "BlockStored"...)
		p = append(p, 0x91, 0xcf)
		p = binary.BigEndian.AppendUint64(p, hash)
		p = append(p, 0xc0, 0x90, 0x10, 0xc0) // parent nil, no tokens, block_size 16, lora_id nil
		return append(p, medium...)
	}
	batch := []byte{0x93, 0x01, 0x93} // [1, [3 events], 0]
	batch = append(batch, stored(21, []byte{0xa3, 'G', 'P', 'U'})...)
	batch = append(batch, stored(22, []byte{0x07})...)
	batch = append(batch, stored(23, []byte{0xa3, 'G', 'P', 'U'})...)
	batch = append(batch, 0x00)
	subj, _ := kvstream.EventsSubject(e.pool, "i0")
	h := kvstream.EventHeaders{Seq: 1, HasSeq: true, Pool: e.pool, Instance: "i0"}
	if _, err := e.js.PublishMsg(e.ctx, &nats.Msg{Subject: subj, Data: batch, Header: h.Header()}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 20*time.Second, "batch applied and counted", func() bool {
		return counterValue(c.m.invalid) == 1 && counterValue(c.m.applied) == 1
	})
	if got, _ := a.get("i0"); !slices.Equal(got, []uint64{21, 23}) {
		t.Fatalf("applied stores %v, want [21 23]", got)
	}
	for _, s := range c.Instances() {
		if s.Instance == "i0" && (s.Invalid != 1 || s.Malformed != 0) {
			t.Fatalf("status %+v, want invalid 1, malformed 0", s)
		}
	}
}

// A snapshot that cannot be read is tried again at the instance's next
// heartbeat, not only at its next event: a quiet engine sends none, and
// its blocks would stay out of the index until it did.
func TestUnreadableSnapshotRetriedAtHeartbeat(t *testing.T) {
	e := newEnv(t)
	e.putSnapshotBytes("i0", []byte("not a snapshot"))
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	c := e.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "the start-up load failed", func() bool {
		var m dto.Metric
		_ = c.m.snapshotLoads.WithLabelValues("error").Write(&m)
		return m.GetCounter().GetValue() >= 1
	})
	e.putSnapshotBytes("i0", e.oneBlockSnapshot("i0", 100))
	// No event: only heartbeats.
	testenv.WaitFor(t, 15*time.Second, "the snapshot loaded at a heartbeat", func() bool {
		e.heartbeat("i0")
		s, _ := a.get("i0")
		return slices.Equal(s, []uint64{100})
	})
}

// A snapshot that stays unreadable is not fetched again at every event: a
// busy engine's events would each wait for a failed load (three tries,
// with pauses), and so would every instance of the shard behind them.
// Retries are spaced in time; the events apply from the stream meanwhile.
func TestUnreadableSnapshotRetriesSpaced(t *testing.T) {
	e := newEnv(t)
	e.putSnapshotBytes("i0", []byte("not a snapshot"))
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.Shards = a, 1 // i0 and i1 share the one shard
	c := e.start(cfg)
	const n = 300
	for i := uint64(1); i <= n; i++ {
		e.store("i0", i, 1000+i)
	}
	e.store("i1", 1, 7)
	testenv.WaitFor(t, 20*time.Second, "every event applied, the other instance's too", func() bool {
		s0, _ := a.get("i0")
		s1, _ := a.get("i1")
		return len(s0) == n && len(s1) == 1
	})
	var m dto.Metric
	_ = c.m.snapshotLoads.WithLabelValues("error").Write(&m)
	if got := m.GetCounter().GetValue(); got > 20 {
		t.Fatalf("%v failed snapshot loads for %d events: retried per event, not spaced in time", got, n)
	}
}

// A failed load's next try: a second at the soonest, nine times the
// failure's own duration for a slow one, the stale window at the latest.
func TestLoadRetryAt(t *testing.T) {
	start := time.Unix(1000, 0)
	for _, c := range []struct{ took, want time.Duration }{
		{time.Millisecond, time.Second},
		{500 * time.Millisecond, 4500 * time.Millisecond},
		{6 * time.Second, 15 * time.Second},
	} {
		end := start.Add(c.took)
		if got := loadRetryAt(start, end, 15*time.Second).Sub(end); got != c.want {
			t.Errorf("a load that failed after %v: retry %v later, want %v", c.took, got, c.want)
		}
	}
}

// Two kvbridges publishing for one instance by mistake (a second sidecar, a
// bridge with another engine's --instance) are told apart from a bridge
// restart by their message ids (<pool>.<instance>.<run>.<n>): a restart
// moves to a new run for good, two live bridges alternate. Counted and
// logged; a restart is not.
func TestTwoBridgesForOneInstance(t *testing.T) {
	e := newEnv(t)
	c, _ := e.startRecording()
	subj, _ := kvstream.EventsSubject(e.pool, "i0")
	pub := func(run string, seq uint64) {
		t.Helper()
		p, _ := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{{Kind: events.BlockStored,
			BlockHashes: []uint64{seq}, TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}}, events.EncodingMap)
		h := kvstream.EventHeaders{Seq: seq, HasSeq: true, Pool: e.pool, Instance: "i0"}.Header()
		h.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s.i0.%s.%d", e.pool, run, seq))
		if _, err := e.js.PublishMsg(e.ctx, &nats.Msg{Subject: subj, Data: p, Header: h}); err != nil {
			t.Fatal(err)
		}
	}
	var seq uint64
	applied := func(seq uint64) {
		t.Helper()
		testenv.WaitFor(t, 20*time.Second, fmt.Sprintf("seq %d applied", seq), func() bool {
			for _, s := range c.Instances() {
				if s.Instance == "i0" && s.LastSeq >= seq {
					return true
				}
			}
			return false
		})
	}
	for _, step := range []struct {
		what string
		runs []string // the runs of the next messages, in order
		want float64  // the counter after them
	}{
		{"a bridge, its restart (a new run), another restart", []string{"aaaa", "aaaa", "bbbb", "cccc"}, 0},
		{"two bridges at once: their messages alternate", []string{"dddd", "cccc", "dddd"}, 2},
	} {
		for _, run := range step.runs {
			seq++
			pub(run, seq)
		}
		applied(seq)
		if n := counterValue(c.m.twoBridges); n != step.want {
			t.Fatalf("%s: counted %v, want %v", step.what, n, step.want)
		}
	}
}

// A router with an index of its own lists the bucket's snapshots, then
// consumes the stream from its start: a message stored between the two,
// of an instance in no snapshot listed (and one with a snapshot, stored
// after it), is delivered like any other.
func TestStartWindowMemory(t *testing.T) {
	e := newEnv(t)
	e.putSnapshotBytes("listed", e.oneBlockSnapshot("listed", 1))
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier = a
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.afterListing = func() {
		e.store("listed", 1, 2)
		e.store("late", 1, 3)
	}
	testenv.Go(t, e.ctx, c.Run)
	testenv.WaitFor(t, 30*time.Second, "both instances' blocks applied", func() bool {
		l, _ := a.get("listed")
		n, _ := a.get("late")
		return slices.Contains(l, 1) && slices.Contains(l, 2) && slices.Equal(n, []uint64{3})
	})
}
