package kvaware

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// Shadow runs a pool's strategy and, beside it, scores every request with
// the strategy not in use (kv_aware when prefix_aware or another heuristic
// routes; prefix_aware when kv_aware does). Only the strategy in use
// routes and changes state (speculative entries, pending prefill); the
// other is evaluated dry. Each comparison records whether the two agree,
// the matched tokens and TTFT the index predicts for both picks, and —
// when the request ends — what the engine reported as cached.
type Shadow struct {
	inUse  router.Strategy
	kv     *KVAware
	prefix *router.PrefixAware
}

var _ router.Strategy = (*Shadow)(nil)

// NewShadow wraps inUse with shadow scoring over kv (whose KVState keeps
// the comparison). When inUse is kv itself, prefix_aware is the shadow.
func NewShadow(inUse router.Strategy, kv *KVAware) *Shadow {
	return &Shadow{inUse: inUse, kv: kv, prefix: router.NewPrefixAware(kv.threshold, kv.rnd)}
}

// kvAwareOf is the kv_aware that scores for s, a pool's strategy: s
// itself, or the one shadow scoring wraps; nil for any other.
func kvAwareOf(s router.Strategy) *KVAware {
	switch v := s.(type) {
	case *KVAware:
		return v
	case *Shadow:
		return v.kv
	}
	return nil
}

// Held is KVAware.Held when kv_aware is the strategy in use; ok is false
// otherwise (a heuristic routes: what shadow scoring knows changes
// nothing, as with shadow off).
func (s *Shadow) Held(ctx context.Context, req *router.Request, cands []*router.Instance) (held, prompt int, ok bool) {
	if s.inUse != router.Strategy(s.kv) {
		return 0, 0, false
	}
	return s.kv.Held(ctx, req, cands)
}

// HeldBy is KVAware.HeldBy when kv_aware is the strategy in use; ok is
// false otherwise (see Held).
func (s *Shadow) HeldBy(ctx context.Context, req *router.Request, cands []*router.Instance, dst []int) (per []int, prompt int, ok bool) {
	if s.inUse != router.Strategy(s.kv) {
		return dst, 0, false
	}
	return s.kv.HeldBy(ctx, req, cands, dst)
}

// Name implements Strategy: the strategy in use.
func (s *Shadow) Name() string { return s.inUse.Name() }

// shadowRecord is one comparison, completed by the request's observer.
type shadowRecord struct {
	inUse, other         string
	inUsePick, otherPick shadowPick
	agree                bool
}

type shadowPick struct {
	inst    string
	matched int
	ttft    float64 // seconds
}

// Pick implements Strategy.
func (s *Shadow) Pick(ctx context.Context, req *router.Request, cands []*router.Instance) (router.Decision, error) {
	var dec, other router.Decision
	var ev *kvEval
	var err error
	otherName := config.StrategyKVAware
	if s.inUse == router.Strategy(s.kv) {
		dec, ev, err = s.kv.pick(ctx, req, cands, true) // held for its turn when sequencing
		if err != nil {
			return dec, err
		}
		other, _ = s.prefix.Pick(ctx, req, cands)
		otherName = config.StrategyPrefixAware
	} else {
		if dec, err = s.inUse.Pick(ctx, req, cands); err != nil {
			return dec, err
		}
		if other, ev, err = s.kv.pick(ctx, req, cands, false); err != nil {
			return dec, nil // shadow scoring never fails a request
		}
	}
	defer s.kv.st.putEval(ev)
	st := s.kv.st
	rec := &shadowRecord{
		inUse: s.inUse.Name(), other: otherName,
		inUsePick: predictedPick(ev, dec.Instance), otherPick: predictedPick(ev, other.Instance),
		agree: dec.Instance == other.Instance,
	}
	st.m.shadow.WithLabelValues(st.pool, strconv.FormatBool(rec.agree)).Inc()
	for _, p := range []struct {
		name string
		p    shadowPick
	}{{rec.inUse, rec.inUsePick}, {rec.other, rec.otherPick}} {
		st.m.shadowMatched.WithLabelValues(st.pool, p.name).Add(float64(p.p.matched))
		if ev.tokens > 0 {
			st.m.shadowTTFT.WithLabelValues(st.pool, p.name).Observe(p.p.ttft)
		}
	}
	st.cmp.addShadow(rec, st.now())
	if o, ok := dec.Observer.(*kvObserver); ok {
		o.shadow = rec
	} else if dec.Observer == nil && ev.tokens > 0 {
		// A heuristic in use: follow the request too, so the comparison
		// learns what the engine reported for the heuristic's pick, and
		// explain what the index predicted for it.
		ce := ev.find(dec.Instance)
		if ce != nil && dec.Explain == nil {
			dec.Explain = &router.Explanation{MatchedTokens: ce.matched, PromptTokens: ev.tokens, PredictedTTFT: seconds(ce.ttft)}
		}
		o, _ := st.newObserver(dec.Instance.ID(), ev.tokens-rec.inUsePick.matched, rec.inUsePick.matched)
		o.shadow = rec
		dec.Observer = o
	}
	return dec, nil
}

func predictedPick(ev *kvEval, inst *router.Instance) shadowPick {
	p := shadowPick{}
	if inst == nil {
		return p
	}
	p.inst = inst.ID()
	if ce := ev.find(inst); ce != nil {
		p.matched = ce.held()
		p.ttft = ce.ttft
	}
	return p
}

// Preview is the decision kv_aware would make for req over cands now,
// evaluated dry, and prefix_aware's (the hash kv_aware falls back to) beside
// it: nothing is committed (no speculative entries, pending prefill,
// averages, rent, metrics or replica-sync change), so asking several router
// replicas at one instant compares what each would decide from the state it
// holds, and an operator can ask why a prompt would go where it goes
// (POST /admin/pools/{pool}/decide). s is a pool's strategy: kv_aware
// itself or shadow scoring around it; any other is an error.
func Preview(ctx context.Context, s router.Strategy, req *router.Request, cands []*router.Instance) (kv, hash router.Decision, err error) {
	k := kvAwareOf(s)
	if k == nil {
		return kv, hash, fmt.Errorf("%w: strategy %s does not score with kv_aware", ErrNoPreview, s.Name())
	}
	kv, ev, err := k.pick(ctx, req, cands, false)
	if err != nil {
		return kv, hash, err
	}
	defer k.st.putEval(ev)
	if hash, err = k.fallback.Pick(ctx, req, cands); err != nil {
		return kv, hash, err
	}
	// kv_aware's prediction for the hash's pick, as for its own.
	if ce := ev.find(hash.Instance); ce != nil && ev.tokens > 0 {
		hash.Explain = &router.Explanation{MatchedTokens: ce.matched, PromptTokens: ev.tokens, PredictedTTFT: seconds(ce.ttft)}
	}
	return kv, hash, nil
}

// ErrNoPreview: the pool's strategy does not score with kv_aware (neither
// kv_aware nor shadow scoring), so there is no exact decision to preview.
var ErrNoPreview = errors.New("kvaware: no kv_aware decision to preview")
