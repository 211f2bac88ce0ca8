package grpcapi

import (
	"context"
	"math"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/tiers"
)

// watchFlushTimeout bounds the round trip that makes a new Watch
// subscription live on the NATS server (a loopback or in-cluster RTT is
// milliseconds; seconds mean the server is unreachable).
const watchFlushTimeout = 5 * time.Second

type eventsService struct {
	kvrouterv1.UnimplementedEventsServer
	s *Server
}

// watchFilter is a parsed WatchRequest.
type watchFilter struct {
	instance string
	tiers    tiers.Set // 0 = every tier
	kinds    uint8     // bit per events.Kind; 0 = every kind
}

func newWatchFilter(in *kvrouterv1.WatchRequest) (watchFilter, error) {
	f := watchFilter{instance: in.GetInstance()}
	if f.instance != "" {
		if err := kvstream.ValidToken("instance", f.instance); err != nil {
			return f, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	for _, t := range in.GetTiers() {
		if t <= kvrouterv1.Tier_TIER_UNSPECIFIED || int(t) > tiers.Count {
			return f, status.Errorf(codes.InvalidArgument, "tiers: unknown tier %v", t)
		}
		f.tiers |= tiers.Tier(t - 1).Bit()
	}
	for _, k := range in.GetKinds() {
		if k <= kvrouterv1.EventKind_EVENT_KIND_UNSPECIFIED || k > kvrouterv1.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED {
			return f, status.Errorf(codes.InvalidArgument, "kinds: unknown kind %v", k)
		}
		f.kinds |= 1 << uint8(k)
	}
	return f, nil
}

// keep reports whether an event passes the filter, and its tier.
func (f watchFilter) keep(e *events.Event) (kvrouterv1.Tier, bool) {
	if f.kinds != 0 && f.kinds&(1<<uint8(e.Kind)) == 0 {
		return 0, false
	}
	if e.Kind == events.AllBlocksCleared {
		return kvrouterv1.Tier_TIER_UNSPECIFIED, true // spans every tier
	}
	t, _ := tiers.FromMedium(e.Medium)
	if f.tiers != 0 && !f.tiers.Has(t) {
		return 0, false
	}
	return kvrouterv1.Tier(t + 1), true
}

// Watch implements kvrouter.v1.Events: it subscribes to the pool's
// kv.events subjects on NATS (core subscription: live events only, no
// history) and sends each decoded event that passes the filter. A watcher
// that falls WatchBuffer messages behind loses messages rather than slow
// the router; the next event sent says how many (Event.dropped).
func (x eventsService) Watch(in *kvrouterv1.WatchRequest, stream kvrouterv1.Events_WatchServer) error {
	s := x.s
	if s.cfg.NATS == nil {
		return status.Error(codes.Unavailable, "events: the router has no NATS connection")
	}
	if in.GetPool() == "" {
		return status.Error(codes.InvalidArgument, "pool: required")
	}
	subj, err := kvstream.PoolSubjects(kvstream.SubjectEvents, in.GetPool())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	f, err := newWatchFilter(in)
	if err != nil {
		return err
	}
	if _, ok := s.pools.Pool(in.GetPool()); !ok {
		// Only the router's own pools: watchers cannot mint metric labels.
		return status.Errorf(codes.NotFound, "events: no pool %q", in.GetPool())
	}
	if f.instance != "" {
		subj = kvstream.SubjectEvents + "." + in.GetPool() + "." + f.instance
	}
	ch := make(chan *nats.Msg, s.cfg.WatchBuffer)
	w := &watcher{x: x, stream: stream, pool: in.GetPool(), f: f}
	sub, err := s.cfg.NATS.Subscribe(subj, func(m *nats.Msg) {
		select {
		case ch <- m:
		default:
			// The callback must not block NATS' delivery goroutine: drop
			// and count, so the client learns it missed events.
			w.dropped.Add(1)
			s.m.watchDropped.WithLabelValues(in.GetPool()).Inc()
		}
	})
	if err != nil {
		return status.Errorf(codes.Unavailable, "events: subscribe %s: %v", subj, err)
	}
	// The library queues messages for the callback; the callback never
	// blocks, so the queue only absorbs bursts. Should it overflow anyway,
	// its drops are counted too (see watcher.libDrops).
	_ = sub.SetPendingLimits(max(s.cfg.WatchBuffer*2, 1<<16), 64<<20)
	w.sub = sub
	defer func() { _ = sub.Unsubscribe() }()
	// Flush needs a deadline (nats.go refuses a context without one) and a
	// watch client normally sets none: bound the round trip here.
	fctx, fcancel := context.WithTimeout(stream.Context(), watchFlushTimeout)
	err = s.cfg.NATS.FlushWithContext(fctx)
	fcancel()
	if err != nil {
		return status.Errorf(codes.Unavailable, "events: subscribe %s: %v", subj, err)
	}
	// Headers sent now tell the client the subscription is live: events
	// published after it receives them reach it.
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	ctx := stream.Context()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.stopping:
			return nil
		case m := <-ch:
			if err := w.send(m); err != nil {
				return err
			}
		}
	}
}

// watcher is one Watch call's state.
type watcher struct {
	x      eventsService
	stream kvrouterv1.Events_WatchServer
	pool   string
	f      watchFilter
	// dropped counts messages dropped since the last event sent; the NATS
	// callback adds, the sending goroutine takes.
	dropped atomic.Uint64
	// sub and libSeen (the library's drop count already reported) are used
	// by the sending goroutine only.
	sub     *nats.Subscription
	libSeen int
}

// libDrops adds the messages the NATS client library dropped for this
// subscription (slow consumer) since the last call to the dropped count.
func (w *watcher) libDrops() {
	if w.sub == nil {
		return
	}
	if d, err := w.sub.Dropped(); err == nil && d > w.libSeen {
		w.dropped.Add(uint64(d - w.libSeen))
		w.x.s.m.watchDropped.WithLabelValues(w.pool).Add(float64(d - w.libSeen))
		w.libSeen = d
	}
}

func (w *watcher) send(m *nats.Msg) error {
	x, pool := w.x, w.pool
	w.libDrops()
	_, _, instance, err := kvstream.ParseSubject(m.Subject)
	if err != nil {
		x.s.m.watchBad.WithLabelValues(pool).Inc()
		return nil
	}
	var h kvstream.EventHeaders
	if m.Header != nil {
		if hh, err := kvstream.ParseEventHeaders(m.Header); err == nil {
			h = hh
		}
	}
	if !h.Coalesced() {
		return w.sendBatch(instance, m.Data, h.Seq, h.Synthetic)
	}
	// A coalesced message carries several engine payloads, the i-th with
	// engine seq h.Seq+i: each is sent as a message of its own.
	parts, err := kvstream.SplitPayload(h, m.Data, nil)
	if err != nil {
		x.s.m.watchBad.WithLabelValues(pool).Inc()
		x.s.log.Debug("events watch: unsplittable coalesced message skipped", "subject", m.Subject, "err", err)
		return nil
	}
	for i, p := range parts {
		if err := w.sendBatch(instance, p, h.Seq+uint64(i), h.Synthetic); err != nil {
			return err
		}
	}
	return nil
}

// sendBatch sends one engine payload's events that pass the filter.
func (w *watcher) sendBatch(instance string, data []byte, seq uint64, synthetic string) error {
	x, pool, f, stream := w.x, w.pool, w.f, w.stream
	b, err := events.Decode(data)
	if err != nil {
		x.s.m.watchBad.WithLabelValues(pool).Inc()
		x.s.log.Debug("events watch: undecodable batch skipped", "instance", instance, "err", err)
		return nil
	}
	var ts *timestamppb.Timestamp
	if b.TS > 0 && b.TS < math.MaxInt64/1e9 {
		ts = timestamppb.New(time.Unix(0, int64(b.TS*1e9)))
	}
	for i := range b.Events {
		e := &b.Events[i]
		tier, ok := f.keep(e)
		if !ok {
			continue
		}
		out := &kvrouterv1.Event{
			Pool:        pool,
			Instance:    instance,
			Kind:        kvrouterv1.EventKind(e.Kind),
			Tier:        tier,
			Medium:      e.Medium,
			BlockHashes: e.BlockHashes,
			ParentHash:  e.ParentHash,
			HasParent:   e.HasParent,
			BlockSize:   int32(e.BlockSize),
			TokenCount:  int32(len(e.TokenIDs)),
			LoraName:    e.LoraName,
			Seq:         seq,
			Time:        ts,
			Synthetic:   synthetic,
			Dropped:     w.dropped.Swap(0),
		}
		if err := stream.Send(out); err != nil {
			return err
		}
	}
	return nil
}
