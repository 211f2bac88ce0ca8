package kvaware

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// With flow control on a kv_aware pool, HeldBy runs at arrival and the
// pick after admission evaluates the same request again; a request whose
// token ids could not be produced counts once in
// kvrouter_kv_tokenize_errors_total ("Requests whose token ids could not
// be produced"), not once per evaluation.
func TestTokenizeErrorCountedOncePerRequest(t *testing.T) {
	w := newKVWorld(t, 3)
	s := w.strategy(config.RoutingConfig{})
	req := &router.Request{Endpoint: router.EndpointChatCompletions, Pool: "p", Model: kvTestModel, RoutingText: "hello", Tokenizer: failingSource{}}
	req.ShareKeys = true // as cachedHolds sets it
	if _, _, ok := s.HeldBy(context.Background(), req, w.insts, nil); ok {
		t.Fatal("HeldBy ok without tokens")
	}
	kvPick(t, s, req, w.insts)
	if got := counterValue(t, w.st.m.tokenErrs.WithLabelValues("p")); got != 1 {
		t.Errorf("token errors %v for one request (HeldBy at arrival, then the pick), want 1", got)
	}
}
