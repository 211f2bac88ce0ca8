package simserver

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/sim"
)

// Clock maps wall time to the engines' virtual time: virtual = (wall −
// start) × Scale. Scale > 1 runs the fleet faster than real time.
type Clock struct {
	Start time.Time
	Scale float64
}

func (c Clock) virtual(t time.Time) time.Duration {
	return time.Duration(float64(t.Sub(c.Start)) * c.Scale)
}

func (c Clock) wall(v time.Duration) time.Time {
	return c.Start.Add(time.Duration(float64(v) / c.Scale))
}

// waiter collects one request's updates for its HTTP handler.
type waiter struct {
	mu     sync.Mutex // guards ups
	ups    []sim.Update
	notify chan struct{} // capacity 1: "ups grew"
}

func (w *waiter) push(u sim.Update) {
	w.mu.Lock()
	w.ups = append(w.ups, u)
	w.mu.Unlock()
	select {
	case w.notify <- struct{}{}:
	default:
	}
}

// take returns and clears the pending updates.
func (w *waiter) take() []sim.Update {
	w.mu.Lock()
	defer w.mu.Unlock()
	u := w.ups
	w.ups = nil
	return u
}

// publisher is what a driver sends encoded batches to (enginezmq.Publisher).
type publisher interface {
	Publish(payload []byte) (uint64, error)
	Skip(payload []byte) uint64
}

var _ publisher = (*enginezmq.Publisher)(nil)

// driver runs one engine in real time: a goroutine sleeps until the
// engine's next event (or a new request), advances it, and hands updates to
// waiting handlers. A second goroutine publishes event batches so that a
// slow subscriber never stalls the engine.
type driver struct {
	rank  int
	clock Clock
	log   *slog.Logger
	enc   events.Encoding
	hwm   int
	obs   func(sim.Update) // metrics hook, called with mu held

	mu      sync.Mutex // guards eng, waiters, nextID, buf
	eng     *sim.Engine
	waiters map[uint64]*waiter
	nextID  uint64
	buf     []sim.Update

	wake chan struct{}

	pubMu   sync.Mutex // guards queue
	queue   []outMsg
	pubWake chan struct{}
	pub     publisher
	stats   pubStats

	format string     // EventsConfig.Format (engines.go)
	trt    *trtBuffer // FormatTRTLLM: events wait here for POST /kv_cache_events
}

type outMsg struct {
	payload []byte
	skip    bool
}

type pubStats struct {
	mu                            sync.Mutex // guards the counters
	batches, dropped, errors, enc uint64
}

func newDriver(cfg sim.Config, clock Clock, enc events.Encoding, hwm int, pub publisher, log *slog.Logger, trt *trtBuffer) (*driver, error) {
	d := &driver{
		rank: cfg.DPRank, clock: clock, log: log, enc: enc, hwm: hwm, pub: pub, trt: trt,
		waiters: make(map[uint64]*waiter),
		wake:    make(chan struct{}, 1),
		pubWake: make(chan struct{}, 1),
	}
	cfg.TokenUpdates = true
	var sink func(events.Batch)
	if pub != nil || trt != nil {
		sink = d.sink
	}
	eng, err := sim.New(cfg, sink)
	if err != nil {
		return nil, err
	}
	d.eng = eng
	return d, nil
}

// sink encodes a batch (called by the engine with d.mu held) and queues it.
// Beyond hwm queued messages it marks the message skipped: it takes its seq
// and goes to the replay buffer but not to subscribers, as a vLLM PUB
// socket at its high-water mark drops messages.
func (d *driver) sink(b events.Batch) {
	if d.trt != nil {
		d.trt.add(b)
		return
	}
	var payload []byte
	var err error
	if d.format == FormatSGLang {
		payload, err = events.EncodeSGLang(nil, b, events.SGLangOptions{Medium: true})
	} else {
		payload, err = events.Encode(nil, b, d.enc)
	}
	if err != nil {
		d.stats.mu.Lock()
		d.stats.enc++
		d.stats.mu.Unlock()
		d.log.Error("kvsim: encode event batch", "err", err)
		return
	}
	d.pubMu.Lock()
	d.queue = append(d.queue, outMsg{payload: payload, skip: len(d.queue) >= d.hwm})
	d.pubMu.Unlock()
	select {
	case d.pubWake <- struct{}{}:
	default:
	}
}

func (d *driver) runPublisher(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.pubWake:
		}
		d.pubMu.Lock()
		q := d.queue
		d.queue = nil
		d.pubMu.Unlock()
		for _, m := range q {
			d.stats.mu.Lock()
			if m.skip {
				d.stats.dropped++
			} else {
				d.stats.batches++
			}
			d.stats.mu.Unlock()
			if m.skip {
				d.pub.Skip(m.payload)
				continue
			}
			if _, err := d.pub.Publish(m.payload); err != nil {
				d.stats.mu.Lock()
				d.stats.errors++
				d.stats.mu.Unlock()
				d.log.Warn("kvsim: publish", "rank", d.rank, "err", err)
			}
		}
	}
}

// run advances the engine until ctx ends.
func (d *driver) run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		d.mu.Lock()
		d.advanceLocked(time.Now())
		next, ok := d.eng.NextEventTime()
		d.mu.Unlock()
		wait := time.Hour
		if ok {
			wait = max(time.Until(d.clock.wall(next)), 0)
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-timer.C:
		}
	}
}

func (d *driver) advanceLocked(now time.Time) {
	d.buf = d.eng.Advance(d.clock.virtual(now), d.buf[:0])
	for _, u := range d.buf {
		if d.obs != nil {
			d.obs(u)
		}
		w := d.waiters[u.ID]
		if w == nil {
			continue
		}
		w.push(u)
		if u.Kind == sim.Finished || u.Kind == sim.Aborted {
			delete(d.waiters, u.ID)
		}
	}
}

func (d *driver) poke() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// submit queues a request and returns its waiter.
func (d *driver) submit(r sim.Request) (uint64, *waiter, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	d.advanceLocked(now)
	d.nextID++
	r.ID = d.nextID
	w := &waiter{notify: make(chan struct{}, 1)}
	if err := d.eng.Submit(r, d.clock.virtual(now)); err != nil {
		return 0, nil, err
	}
	d.waiters[r.ID] = w
	d.poke()
	return r.ID, w, nil
}

func (d *driver) abort(id uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.waiters, id)
	d.eng.Abort(id, d.clock.virtual(time.Now()))
	d.poke()
}

// with runs f on the engine with the driver's lock held.
func (d *driver) with(f func(e *sim.Engine)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.advanceLocked(time.Now())
	f(d.eng)
	d.poke()
}

// load is what data-parallel dispatch balances: queued plus running requests.
func (d *driver) load() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.eng.Stats()
	return s.Running + s.Waiting + s.Loading
}
