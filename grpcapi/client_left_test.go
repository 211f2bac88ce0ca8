package grpcapi_test

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// seqGrace is how long after its epoch's end a held pick waits for the
// peers' intents in these tests: long enough for a caller's leave to reach
// the server on a loaded machine before the pick's turn comes, so that a
// server which noticed only at the turn is told from one that noticed at
// once.
const seqGrace = 3 * time.Second

// seqEpoch is the epoch the tests' bursts are sequenced in (δ).
const seqEpoch = 20 * time.Millisecond

// sequenced is the harness whose kv pool sequences same-instant bursts
// (replica sync with a live peer, replica "b", on NATS), so that every
// Pick and ext_proc pick of the pool is held for its epoch; the gRPC
// metrics are on reg.
type sequenced struct {
	*harness
	reg *prometheus.Registry
	kv  *kvaware.KVState
}

func newSequenced(t *testing.T) *sequenced {
	t.Helper()
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	mine := servertest.Syncer(t, url, pool, "a", seqEpoch, seqGrace)
	servertest.Syncer(t, url, pool, "b", seqEpoch, seqGrace)
	reg := prometheus.NewRegistry()
	h := newFreshHarness(t, kvstate.PeerFreshness{Syncer: mine}, func(_ *config.Config, g *grpcapi.Config) { g.Registerer = reg })
	testenv.WaitFor(t, 5*time.Second, "the peer live", func() bool { return mine.Live() == 1 })
	// Past the partial epoch the pool's sequencer started in (built with
	// the server), whose requests are not held.
	time.Sleep(seqEpoch)
	p, _ := h.srv.Pool("kv")
	return &sequenced{harness: h, reg: reg, kv: kvaware.Of(p)}
}

func (s *sequenced) held() int64 { return s.kv.SequenceStats().Held }

func (s *sequenced) metric(name string, labels map[string]string) float64 {
	s.t.Helper()
	return servertest.Metric(s.t, s.reg, name, labels)
}

// leftNothing checks that a pick of prompt whose caller left during the
// hold reserved nothing that stays: no request in flight, no pending
// prefill on any instance of the kv pool, and no speculative entry (the
// prompt's next Pick, held for an epoch of its own and answered, matches
// on kv-2 what the index holds, gpu tokens, not the left pick's blocks).
// Of its own: within the left pick's epoch the next would see the left
// one's dry decision on the epoch's overlay, by design (the peers decided
// it too, not knowing it left), until the epoch is decided.
func (s *sequenced) leftNothing(t *testing.T, prompt []uint32, gpu int64) {
	t.Helper()
	p, _ := s.srv.Pool("kv")
	for _, in := range p.Instances() {
		if n := in.InFlight(); n != 0 {
			t.Errorf("%s: %d in flight after the caller left", in.ID(), n)
		}
		if tok, reqs := s.kv.PendingPrefill(in.ID()); tok != 0 || reqs != 0 {
			t.Errorf("%s: %d tokens of %d requests pending prefill after the caller left", in.ID(), tok, reqs)
		}
	}
	time.Sleep(seqEpoch) // past the left pick's epoch
	held := s.held()
	got, err := s.router().Pick(ctxT(t), &kvrouterv1.PickRequest{Pool: "kv", TokenIds: prompt})
	if err != nil {
		t.Fatalf("the next Pick: %v", err)
	}
	if s.held() != held+1 {
		t.Errorf("the next Pick was not held for its epoch (%d held, %d before)", s.held(), held)
	}
	if got.Instance != "kv-2" || got.MatchedTokens.GetGpu() != gpu {
		t.Errorf("the next Pick: %s matching %v, want kv-2 matching %d gpu tokens (the index's, no speculative entry)", got.Instance, got.MatchedTokens, gpu)
	}
}

// A Router.Pick caller that goes away while kv_aware holds its pick for
// its sequencing epoch, cancelling or past its deadline, is a caller that
// left: the server returns at once with its context's code and counts the
// call under it (Canceled: what the HTTP edge counts 499), not Internal
// or Unavailable, and not when the pick's turn comes; the hold leaves
// nothing behind, and the epoch loop goes on (the next Pick is answered).
// A caller past its deadline gets DeadlineExceeded; the server counts
// DeadlineExceeded or Canceled, whichever ended its context first (its own
// deadline, from the grpc-timeout header, or the caller's reset stream).
func TestPickClientLeavesSequencingHold(t *testing.T) {
	for _, tc := range []struct {
		name    string
		code    codes.Code   // the caller's
		counted []codes.Code // the server's, one of
	}{
		{"cancelled", codes.Canceled, []codes.Code{codes.Canceled}},
		{"deadline", codes.DeadlineExceeded, []codes.Code{codes.DeadlineExceeded, codes.Canceled}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSequenced(t)
			prompt := routertest.Prompt(1, 10*bs+5)
			s.store("kv-2", prompt[:6*bs])
			ctx, cancel := context.WithCancel(ctxT(t))
			if tc.code == codes.DeadlineExceeded {
				ctx, cancel = context.WithTimeout(ctxT(t), time.Second)
			}
			defer cancel()
			errc := make(chan error, 1)
			go func() {
				_, err := s.router().Pick(ctx, &kvrouterv1.PickRequest{Pool: "kv", TokenIds: prompt})
				errc <- err
			}()
			testenv.WaitFor(t, 5*time.Second, "the pick held for its epoch", func() bool { return s.held() == 1 })
			if tc.code == codes.Canceled {
				cancel()
			} // else its deadline ends the call during the hold
			if err := <-errc; status.Code(err) != tc.code {
				t.Fatalf("the caller got %v, want %v", err, tc.code)
			}
			picks := func(code codes.Code) float64 {
				return s.metric("kvrouter_grpc_picks_total", map[string]string{"pool": "kv", "code": code.String()})
			}
			left := func() (n float64) {
				for _, c := range tc.counted {
					n += picks(c)
				}
				return n
			}
			deadline := time.Now().Add(seqGrace / 2)
			for left() != 1 {
				if time.Now().After(deadline) {
					t.Fatalf("the pick not counted %v within %v; by code: %v %v, %v %v, %v %v, %v %v", tc.counted, seqGrace/2,
						codes.Canceled, picks(codes.Canceled), codes.Internal, picks(codes.Internal),
						codes.Unavailable, picks(codes.Unavailable), codes.OK, picks(codes.OK))
				}
				time.Sleep(5 * time.Millisecond)
			}
			s.leftNothing(t, prompt, 6*bs)
			if n := s.metric("kvrouter_grpc_picks_total", nil); n != 2 {
				t.Errorf("%v picks counted, want the left one and the next", n)
			}
		})
	}
}

// An ext_proc stream that Envoy ends (its downstream client left) while
// kv_aware holds the request's pick for its sequencing epoch is a client
// that left: counted outcome 499, as the HTTP edge counts one, not a
// failed pick (500) or no eligible instance (503), at once rather than at
// the pick's turn; nothing is acquired or held, and the next pick is made.
func TestExtProcClientLeavesSequencingHold(t *testing.T) {
	s := newSequenced(t)
	prompt := routertest.Prompt(1, 10*bs+5)
	s.store("kv-2", prompt[:6*bs])
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	st, err := extprocv3.NewExternalProcessorClient(s.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	e := &envoy{t: t, st: st}
	e.headers(nil, false, ":method", "POST", ":path", "/v1/completions")
	body, _ := json.Marshal(map[string]any{"model": kvModel, "prompt": prompt})
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 5*time.Second, "the pick held for its epoch", func() bool { return s.held() == 1 })
	cancel()
	outcome := func(o string) float64 {
		return s.metric("kvrouter_extproc_requests_total", map[string]string{"pool": "kv", "outcome": o})
	}
	deadline := time.Now().Add(seqGrace / 2)
	for outcome("499") != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the stream not counted 499 within %v; by outcome: 500 %v, 503 %v, routed %v", seqGrace/2,
				outcome("500"), outcome("503"), outcome("routed"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := s.metric("kvrouter_extproc_requests_total", nil); n != 1 {
		t.Errorf("%v ext_proc outcomes counted, want the one 499", n)
	}
	s.leftNothing(t, prompt, 6*bs)
}

// A pick held for its sequencing epoch while a reload removes the instance
// it would take, and the reloads' sweeps forget that instance (sweepLeft:
// idle, as nothing is in flight there during the hold), is made among the
// instances still in the pool when its turn comes: it neither names the
// instance that left nor writes kv_aware's state and series for it, which
// no sweep would forget any more.
func TestPickHeldWhileItsInstanceLeaves(t *testing.T) {
	s := newSequenced(t)
	prompt := routertest.Prompt(1, 10*bs+5)
	s.store("kv-2", prompt[:6*bs])
	type answer struct {
		out *kvrouterv1.PickResponse
		err error
	}
	ac := make(chan answer, 1)
	go func() {
		out, err := s.router().Pick(ctxT(t), &kvrouterv1.PickRequest{Pool: "kv", TokenIds: prompt})
		ac <- answer{out, err}
	}()
	testenv.WaitFor(t, 5*time.Second, "the pick held for its epoch", func() bool { return s.held() == 1 })
	var cfg config.Config
	for _, p := range s.srv.Pools() {
		pc := p.Config()
		if pc.Name == "kv" {
			pc.Instances = slices.DeleteFunc(slices.Clone(pc.Instances), func(ic config.InstanceConfig) bool { return ic.ID == "kv-2" })
		}
		cfg.Pools = append(cfg.Pools, pc)
	}
	// Two reloads, two sweeps: kv-2, idle, is forgotten and dropped.
	for range 2 {
		if err := s.srv.Reload(cfg); err != nil {
			t.Fatal(err)
		}
	}
	a := <-ac
	if a.err != nil {
		t.Fatalf("the held pick: %v", a.err)
	}
	if a.out.Instance == "kv-2" {
		t.Errorf("the held pick named kv-2, which left the pool during the hold")
	}
	pending := servertest.Metric(t, s.srv.Registry(), "kvrouter_kv_pending_prefill_tokens", map[string]string{"pool": "kv", "instance": "kv-2"})
	if tok, reqs := s.kv.PendingPrefill("kv-2"); tok != 0 || reqs != 0 || pending != 0 || seriesOf(t, s.srv.Registry(), "kvrouter_kv_pending_prefill_tokens", "kv-2") {
		t.Errorf("kv_aware keeps pending prefill for kv-2 after it left: %d tokens, %d requests; series present %v", tok, reqs,
			seriesOf(t, s.srv.Registry(), "kvrouter_kv_pending_prefill_tokens", "kv-2"))
	}
}

// seriesOf reports whether the family name gathered from g has a series
// of instance inst.
func seriesOf(t *testing.T, g prometheus.Gatherer, name, inst string) bool {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "instance" && l.GetValue() == inst {
					return true
				}
			}
		}
	}
	return false
}
