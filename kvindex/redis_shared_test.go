package kvindex

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
)

// sharedMsg is one stream message: its sequence, instance and events.
type sharedMsg struct {
	seq  uint64
	inst string
	evs  []events.Event
}

// sharedLog draws n random messages over instances, sequences 1..n.
func sharedLog(seed uint64, n int, insts []string) ([]sharedMsg, *propWorld) {
	rng := rand.New(rand.NewPCG(seed, 5))
	w := newPropWorld(rng, testModel)
	out := make([]sharedMsg, n)
	for i := range out {
		evs := make([]events.Event, 1+rng.IntN(4))
		for j := range evs {
			evs[j] = w.randomEvent(rng)
			if evs[j].Kind == events.AllBlocksCleared && rng.IntN(3) > 0 {
				evs[j] = w.randomEvent(rng) // clears: rarer than in the property test
			}
		}
		out[i] = sharedMsg{seq: uint64(i + 1), inst: insts[rng.IntN(len(insts))], evs: evs}
	}
	return out, w
}

// sharedRouter plays one router's consumer against a shared index: every
// message in order through ApplyAt; when the index is behind, the missing
// messages of the instance again from the log (the stream), or, when the
// instance is not seeded, a load of its state: a clear and every earlier
// message of the instance (what a bridge snapshot holds). Redis errors are
// retried until ctx ends.
type sharedRouter struct {
	r    *Redis
	log  []sharedMsg
	from map[string]Position
	// counts per status, for the test's checks
	applied, loads atomic.Int64
}

func (s *sharedRouter) run(ctx context.Context, upTo int) error {
	s.from = map[string]Position{}
	for i := 0; i < upTo; i++ {
		m := s.log[i]
		for {
			err := s.deliver(ctx, i)
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return fmt.Errorf("message %d: %w", m.seq, err)
			}
			time.Sleep(5 * time.Millisecond) // Redis down: retry
		}
	}
	return nil
}

func (s *sharedRouter) deliver(ctx context.Context, i int) error {
	m := s.log[i]
	for attempt := 0; attempt < 10; attempt++ {
		res, err := s.r.ApplyAt(ctx, m.inst, s.from[m.inst], m.seq, m.evs)
		if err != nil {
			return err
		}
		switch res.Status {
		case SeqApplied, SeqDuplicate, SeqNotOwner:
			if res.Status == SeqApplied {
				s.applied.Add(1)
			}
			s.from[m.inst] = Position{Seq: m.seq, Seeded: true}
			return nil
		}
		// Behind: repair from the log, then try again.
		pos := res.Position
		if !pos.Seeded {
			snap := []events.Event{{Kind: events.AllBlocksCleared}}
			at := uint64(0)
			for _, p := range s.log[:i] {
				if p.inst == m.inst {
					snap = append(snap, p.evs...)
					at = p.seq
				}
			}
			lr, err := s.r.LoadAt(ctx, m.inst, at, snap)
			if err != nil {
				return err
			}
			if lr.Status == SeqApplied {
				s.loads.Add(1)
			}
			if lr.Status == SeqNotOwner {
				time.Sleep(time.Millisecond)
			}
			s.from[m.inst] = Position{Seq: at, Seeded: true}
			continue
		}
		s.from[m.inst] = pos
		for _, p := range s.log[:i] {
			if p.inst != m.inst || p.seq <= pos.Seq {
				continue
			}
			res, err := s.r.ApplyAt(ctx, p.inst, s.from[p.inst], p.seq, p.evs)
			if err != nil {
				return err
			}
			if res.Status != SeqApplied {
				break // another router moved it: start over
			}
			s.applied.Add(1)
			s.from[p.inst] = res.Position
		}
	}
	return fmt.Errorf("message %d: index kept moving", m.seq)
}

// settle makes sure the messages this router skipped because another
// router held the lease were applied: a router that died holding it left
// them out, and the instance may see no further message to notice at.
// Once the lease has run out, this router applies them from the log.
func (s *sharedRouter) settle(ctx context.Context) error {
	for inst, want := range s.from {
		for {
			pos, err := s.r.Position(ctx, inst)
			if err != nil {
				return err
			}
			if pos.Seeded && pos.Seq >= want.Seq {
				break
			}
			moved := false
			for _, p := range s.log {
				if p.inst != inst || p.seq <= pos.Seq || p.seq > want.Seq {
					continue
				}
				res, err := s.r.ApplyAt(ctx, inst, pos, p.seq, p.evs)
				if err != nil {
					return err
				}
				if res.Status != SeqApplied {
					break
				}
				s.applied.Add(1)
				pos, moved = res.Position, true
			}
			if !moved {
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(10 * time.Millisecond): // the lease is still held
				}
			}
		}
	}
	return nil
}

// refCounts are the reference's per-tier block counts of an instance.
func (r *refIndex) counts(inst string) [tiers.Count]int {
	var out [tiers.Count]int
	for _, e := range r.inst[inst] {
		for t := range tiers.Count {
			if e.bits.Has(tiers.Tier(t)) {
				out[t]++
			}
		}
	}
	return out
}

// checkShared compares the shared index with the reference built from the
// whole log: counters, Len, lookups and positions.
func checkShared(t *testing.T, r *Redis, log []sharedMsg, w *propWorld, insts []string) {
	t.Helper()
	ctx := context.Background()
	ref := &refIndex{model: testModel, bs: 4, inst: map[string]map[uint64]refEntry{}}
	last := map[string]uint64{}
	for _, m := range log {
		ref.apply(m.inst, m.evs)
		last[m.inst] = m.seq
	}
	stats, err := r.Instances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][tiers.Count]int{}
	for _, s := range stats {
		got[s.Instance] = s.Blocks
	}
	for _, inst := range insts {
		if got[inst] != ref.counts(inst) {
			t.Errorf("%s: counters %v, engine truth %v", inst, got[inst], ref.counts(inst))
		}
		if p, err := r.Position(ctx, inst); err != nil || p != (Position{Seq: last[inst], Seeded: true}) {
			t.Errorf("%s: position %v (%v), want %d", inst, p, err, last[inst])
		}
	}
	if n, err := r.Len(ctx); err != nil || n != ref.len() {
		t.Errorf("Len = %d (%v), reference %d", n, err, ref.len())
	}
	for d := range w.keys {
		checkLookup(t, r, query{keys: w.keys[d], want: ref.lookup(w.keys[d])}, fmt.Sprintf("doc %d", d))
	}
}

// watchCounters reads every instance's counters until stop closes and
// reports any negative one.
func watchCounters(t *testing.T, r *Redis, stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			stats, err := r.Instances(context.Background())
			if err != nil {
				time.Sleep(5 * time.Millisecond) // Redis down in the restart test
				continue
			}
			for _, s := range stats {
				for tier, n := range s.Blocks {
					if n < 0 {
						t.Errorf("%s: counter of tier %d is %d", s.Instance, tier, n)
					}
				}
			}
		}
	})
	return &wg
}

// newSharedIndexes returns n indexes on one Redis and prefix, as n routers
// have: their own clients, short leases (takeovers within the test), exact
// lookups (the random log punches holes in chains, see ExactLookup).
func newSharedIndexes(t *testing.T, addr, prefix string, n int) []*Redis {
	out := make([]*Redis, n)
	for i := range out {
		c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 4, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
		t.Cleanup(func() { _ = c.Close() })
		r, err := NewRedis(c, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4, WriterLease: 100 * time.Millisecond, ExactLookup: true})
		if err != nil {
			t.Fatal(err)
		}
		out[i] = r
	}
	return out
}

// Two and three routers apply the same stream to one Redis index at once;
// one of them stops half-way while it holds writer leases (a router that
// died). Every message is applied once: the counters equal the engines'
// truth and are never negative, lookups and positions are exact.
func TestRedisSharedWriters(t *testing.T) {
	insts := []string{"a", "b", "c"}
	for _, routers := range []int{2, 3} {
		t.Run(fmt.Sprintf("routers=%d", routers), func(t *testing.T) {
			srv := testenv.StartRedis(t)
			idx := newSharedIndexes(t, srv.Addr, testenv.UniqueName(t), routers)
			log, w := sharedLog(uint64(routers)*101, 300, insts)
			stop := make(chan struct{})
			watch := watchCounters(t, idx[0], stop)
			ctx := testenv.Context(t, time.Minute)
			var wg sync.WaitGroup
			rs := make([]*sharedRouter, routers)
			for i := range rs {
				rs[i] = &sharedRouter{r: idx[i], log: log}
				upTo := len(log)
				if i == 0 {
					upTo = len(log) / 2 // dies holding its leases
				}
				wg.Go(func() {
					if err := rs[i].run(ctx, upTo); err != nil {
						t.Error(err)
					}
					if i == 0 {
						return
					}
					if err := rs[i].settle(ctx); err != nil {
						t.Error(err)
					}
				})
			}
			wg.Wait()
			close(stop)
			watch.Wait()
			var applied int64
			for _, s := range rs {
				applied += s.applied.Load()
			}
			// Each message once, plus those a load replaced... none here:
			// Redis never lost anything, so no instance was loaded.
			if applied != int64(len(log)) {
				t.Errorf("%d applications of %d messages", applied, len(log))
			}
			checkShared(t, idx[1], log, w, insts)
		})
	}
}

// Redis is killed half-way and comes back empty while three routers
// apply: their writes fail during the gap, then every instance is found
// unseeded, loaded once from its snapshot, and the stream goes on from
// there. The epoch changes, so a router can tell.
func TestRedisSharedRestartEmpty(t *testing.T) {
	insts := []string{"a", "b", "c"}
	srv := testenv.StartRedis(t)
	idx := newSharedIndexes(t, srv.Addr, testenv.UniqueName(t), 3)
	ctx := testenv.Context(t, time.Minute)
	epoch, created, err := idx[0].Epoch(ctx)
	if err != nil || !created {
		t.Fatalf("first epoch: %q created=%v %v", epoch, created, err)
	}
	if e, created, err := idx[1].Epoch(ctx); err != nil || created || e != epoch {
		t.Fatalf("second router's epoch %q created=%v %v, want %q", e, created, err, epoch)
	}
	log, w := sharedLog(7, 300, insts)
	half := len(log) / 2
	rs := make([]*sharedRouter, 3)
	var wg sync.WaitGroup
	for i := range rs {
		rs[i] = &sharedRouter{r: idx[i], log: log}
		wg.Go(func() {
			if err := rs[i].run(ctx, half); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	checkShared(t, idx[0], log[:half], w, insts)

	stop := make(chan struct{})
	watch := watchCounters(t, idx[0], stop)
	srv.Kill()
	for i := range rs {
		// The routers go on where they were: the first messages fail.
		wg.Go(func() {
			from := rs[i].from
			rs[i].from = nil
			for j := half; j < len(log); j++ {
				for {
					if rs[i].from == nil {
						rs[i].from = from
					}
					err := rs[i].deliver(ctx, j)
					if err == nil {
						break
					}
					if ctx.Err() != nil {
						t.Error(err)
						return
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
		})
	}
	time.Sleep(100 * time.Millisecond) // the routers meet a dead Redis
	srv.Start()
	wg.Wait()
	close(stop)
	watch.Wait()
	checkShared(t, idx[2], log, w, insts)
	var loads int64
	for _, s := range rs {
		loads += s.loads.Load()
	}
	// At least one load per instance; a router whose lease ran out while
	// another was behind may load a later snapshot over it (correct, if
	// redundant).
	if loads < int64(len(insts)) {
		t.Errorf("%d loads after the restart, want at least one per instance (%d)", loads, len(insts))
	}
	if e, _, err := idx[1].Epoch(ctx); err != nil || e == epoch {
		t.Fatalf("epoch after an empty restart %q (%v), was %q: a router cannot tell", e, err, epoch)
	}
}

// ApplyAt's answers, one by one.
func TestRedisApplyAtStatuses(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	idx := newSharedIndexes(t, srv.Addr, testenv.UniqueName(t), 2)
	a, b := idx[0], idx[1]
	c := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	apply := func(r *Redis, from Position, seq uint64, evs ...events.Event) SeqResult {
		t.Helper()
		res, err := r.ApplyAt(ctx, "i", from, seq, evs)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	if res := apply(a, Position{}, 5, c.stored(0, 2)); res.Status != SeqBehind || res.Position.Seeded {
		t.Fatalf("unseeded instance: %+v", res)
	}
	if res, err := a.LoadAt(ctx, "i", 3, []events.Event{c.stored(0, 1)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("load: %+v %v", res, err)
	}
	if res := apply(b, at(3), 5, c.stored(1, 2)); res.Status != SeqNotOwner {
		t.Fatalf("while a holds the lease: %+v", res)
	}
	if res := apply(a, at(2), 5, c.stored(1, 2)); res.Status != SeqBehind || res.Position != at(3) {
		t.Fatalf("wrong expected position: %+v", res)
	}
	if res := apply(a, at(3), 5, c.stored(1, 2)); res.Status != SeqApplied || res.Position != at(5) {
		t.Fatalf("apply: %+v", res)
	}
	if res := apply(a, at(3), 5, c.stored(1, 2)); res.Status != SeqDuplicate {
		t.Fatalf("same message again: %+v", res)
	}
	if res, err := a.LoadAt(ctx, "i", 4, nil); err != nil || res.Status != SeqDuplicate {
		t.Fatalf("load of an older snapshot: %+v %v", res, err)
	}
	time.Sleep(150 * time.Millisecond) // a's lease (100ms) runs out
	if res := apply(b, at(5), 6, c.stored(2, 4)); res.Status != SeqApplied {
		t.Fatalf("takeover after the lease: %+v", res)
	}
	if res := apply(a, at(6), 7, c.removed("GPU", 3, 4)); res.Status != SeqNotOwner {
		t.Fatalf("a after b took over: %+v", res)
	}
	checkLookup(t, a, query{c.keys, map[string][tiers.Count]int{"i": all(4)}}, "after takeover")
	stats, _ := a.Instances(ctx)
	if len(stats) != 1 || stats[0].Blocks != blocks(4, 0, 0, 0) {
		t.Fatalf("counters %+v", stats)
	}
}

// A router that never writes (another holds the lease) still learns the
// block size its lookups need, and one started while the pool is idle
// learns it from Redis at its first epoch check.
func TestRedisSharedBlockSize(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	prefix := testenv.UniqueName(t)
	var idx []*Redis
	for range 3 {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { _ = c.Close() })
		r, err := NewRedis(c, RedisConfig{Prefix: prefix, Model: testModel})
		if err != nil {
			t.Fatal(err)
		}
		idx = append(idx, r)
	}
	ch := newChain(Root(testModel, "", ""), 2, 4, 1, 10)
	if res, err := idx[0].LoadAt(ctx, "i", 1, []events.Event{ch.stored(0, 1)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("load: %+v %v", res, err)
	}
	if res, err := idx[1].ApplyAt(ctx, "i", Position{Seq: 1, Seeded: true}, 2, []events.Event{ch.stored(1, 2)}); err != nil || res.Status != SeqNotOwner {
		t.Fatalf("second router: %+v %v", res, err)
	}
	if bs := idx[1].BlockSize(); bs != 4 {
		t.Fatalf("router that skipped the message: block size %d, want 4", bs)
	}
	if bs := idx[2].BlockSize(); bs != 0 {
		t.Fatalf("fresh router: block size %d before any check", bs)
	}
	if _, _, err := idx[2].Epoch(ctx); err != nil {
		t.Fatal(err)
	}
	if bs := idx[2].BlockSize(); bs != 4 {
		t.Fatalf("fresh router after its epoch check: block size %d, want 4", bs)
	}
}

// A snapshot loaded ahead of the message being applied (the consumer's
// repair after Redis restarted empty fetches the bridge's snapshot, which is
// current to later stream messages than the one in hand) covers that
// message: ApplyAt of it from the loaded position is a duplicate. It used to
// take the fast path (cached map at the expected position, fresh lease),
// send its block writes, be refused by the commit as "dup", answer errMoved
// and unsettle the instance, so that the consumer reloaded the whole
// snapshot at every message until the traffic paused (seen live: 225
// snapshot loads in 8 s after a Redis restart under load).
func TestRedisApplyAtCoveredByLoad(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	a := newSharedIndexes(t, srv.Addr, testenv.UniqueName(t), 1)[0]
	c := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	if res, err := a.LoadAt(ctx, "i", 10, []events.Event{c.stored(0, 3)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("load: %+v %v", res, err)
	}
	// Message 7, older than the snapshot: a removal the snapshot already reflects.
	res, err := a.ApplyAt(ctx, "i", at(10), 7, []events.Event{c.removed("GPU", 0, 3)})
	if err != nil || res.Status != SeqDuplicate || res.Position != at(10) {
		t.Fatalf("message covered by the snapshot: %+v %v, want duplicate at 10", res, err)
	}
	if p, err := a.Position(ctx, "i"); err != nil || p != at(10) {
		t.Fatalf("position after the covered message: %+v %v, want 10", p, err)
	}
	checkLookup(t, a, query{c.keys, map[string][tiers.Count]int{"i": all(3)}}, "after the covered message")
	if res, err := a.ApplyAt(ctx, "i", at(10), 11, []events.Event{c.stored(3, 4)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("next message: %+v %v", res, err)
	}
	checkLookup(t, a, query{c.keys, map[string][tiers.Count]int{"i": all(4)}}, "after the next message")
}
