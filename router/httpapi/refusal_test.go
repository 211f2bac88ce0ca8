package httpapi_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// observedPick decides for one instance with an observer, as kv_aware
// does for every committed decision.
type observedPick struct {
	to  *router.Instance
	obs router.Observer
}

func (p *observedPick) Name() string { return "observed-pick" }

func (p *observedPick) Pick(context.Context, *router.Request, []*router.Instance) (router.Decision, error) {
	return router.Decision{Instance: p.to, Strategy: "observed-pick", Reason: router.ReasonKVMatch, Observer: p.obs}, nil
}

// TestRefusalIsNoPrefill: an upstream that refuses a request at once (vLLM
// answers a prompt over its context 400 before any prefill) ends the
// request with its work given back, but its first byte is no prefill: the
// flow-control queue does not learn a service time from it (a client
// sending over-long prompts would drive the estimate deadline shedding
// and the reservation read towards zero) and the decision's observer is
// not told FirstByte (kv_aware measures its prefill rate there). A
// success still teaches both.
func TestRefusalIsNoPrefill(t *testing.T) {
	h := newHarness(t, 1, nil)
	pool := h.srv.Pools()[0]
	inst := poolInstance(t, pool, h.ups[0].ID)
	gate, err := flowcontrol.NewGate(flowcontrol.Config{InstancePrefill: 8192, MaxConcurrency: 8},
		flowcontrol.WithInstances(func() []string { return []string{inst.ID()} }))
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"go"}],"max_tokens":5,"stream":true}`
	send := func() (status int, o *doneObserver) {
		t.Helper()
		tk, err := gate.Acquire(context.Background(), flowcontrol.Item{Prefill: 3000, Cost: 3500})
		if err != nil {
			t.Fatal(err)
		}
		tk.Bind(inst.ID())
		req := &router.Request{Endpoint: router.EndpointChatCompletions, Pool: pool.Name(), Model: model, Body: []byte(body), Stream: true}
		o = &doneObserver{status: make(chan int, 1)}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		rec := httptest.NewRecorder()
		httpapi.RouteForTest(h.srv, rec, r, pool, &observedPick{to: inst, obs: o}, req, tk, "/v1/chat/completions")
		tk.Done()
		select {
		case st := <-o.status:
			if st != rec.Code {
				t.Errorf("observer ended with %d, the client got %d", st, rec.Code)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the observer never ended")
		}
		if st := gate.Stats(); st.InFlight != 0 || st.PendingPrefill != 0 {
			t.Errorf("after a %d: %d in flight, %d pending prefill in the queue; want nothing held", rec.Code, st.InFlight, st.PendingPrefill)
		}
		if n := inst.InFlight(); n != 0 {
			t.Errorf("after a %d: instance in flight %d, want 0", rec.Code, n)
		}
		return rec.Code, o
	}

	h.ups[0].Set(routertest.Normal, 0, 0)
	if st, o := send(); st != http.StatusOK || o.first != 1 {
		t.Fatalf("served request: status %d, first byte told %d times; want 200, once", st, o.first)
	}
	svc := gate.Stats().ServiceTTFT
	if svc <= 0 {
		t.Fatalf("a served request taught the queue no service time (%v)", svc)
	}
	h.ups[0].Set(routertest.Status, http.StatusBadRequest, 0)
	for range 20 {
		st, o := send()
		if st != http.StatusBadRequest {
			t.Fatalf("refused request: status %d, want the upstream's 400", st)
		}
		if o.first != 0 {
			t.Fatalf("refused request: the observer was told FirstByte %d times, want none", o.first)
		}
	}
	if got := gate.Stats().ServiceTTFT; got != svc {
		t.Errorf("20 refusals moved the queue's service time from %v to %v", svc, got)
	}
}
