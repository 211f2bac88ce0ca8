package router

import (
	"context"
	"reflect"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/tiers"
)

// Response headers of exact routing decisions.
const (
	// HeaderMatchedTokens lists the prompt tokens the chosen instance was
	// predicted to hold, per tier, each beyond faster tiers:
	// "gpu=128,cpu=32,disk=0,shared=0".
	HeaderMatchedTokens = "X-Kvrouter-Matched-Tokens"
	// HeaderPredictedTTFT is the predicted time to first token, in ms.
	HeaderPredictedTTFT = "X-Kvrouter-Predicted-Ttft-Ms"
)

// MatchedTokensHeader formats MatchedTokens as HeaderMatchedTokens does.
func (e *Explanation) MatchedTokensHeader() string {
	var b strings.Builder
	for t, n := range e.MatchedTokens {
		if t > 0 {
			b.WriteByte(',')
		}
		b.WriteString(tiers.Tier(t).String())
		b.WriteByte('=')
		b.WriteString(strconv.Itoa(n))
	}
	return b.String()
}

// PoolOption adjusts a pool built by NewPool.
type PoolOption func(*Pool)

// WithPoolKVState gives the pool its exact-routing state (nil = none).
func WithPoolKVState(st *KVState) PoolOption {
	return func(p *Pool) { p.kv = st }
}

// KV is the pool's exact-routing state, nil when it has no KV index.
func (p *Pool) KV() *KVState { return p.kv }

// kvStateFor builds (or keeps across a reload) a pool's KVState from
// Options.KV and the pool's tokenizer config. A pool without an index gets
// none; selecting kv_aware for it then fails with ErrNoKVState.
func (s *Server) kvStateFor(pc config.PoolConfig, old *Pool) (*KVState, error) {
	if s.kvOpt == nil {
		return nil, nil
	}
	idx, fresh := s.kvOpt(pc)
	if idx == nil {
		return nil, nil
	}
	if old != nil && old.kv != nil && old.kv.index == idx && old.cfg.Model == pc.Model &&
		reflect.DeepEqual(old.cfg.Tokenizer, pc.Tokenizer) {
		return old.kv, nil
	}
	tokens, err := NewTokenSource(pc.Tokenizer, pc)
	if err != nil {
		return nil, err
	}
	return NewKVState(KVStateConfig{
		Pool: pc.Name, Model: pc.Model, Index: idx, Freshness: fresh, Tokens: tokens,
		Metrics: s.kvm, Logger: s.log,
	})
}

// startKVLoopsLocked starts the pool's /metrics load scraper (loopMu held).
func (s *Server) startKVLoopsLocked(ctx context.Context, p *Pool) {
	if p.kv == nil {
		return
	}
	p.kv.setInstances(p.Instances)
	rc, _ := p.Routing()
	sc := resolveScoring(rc.KV)
	if sc.scrape < 0 {
		return
	}
	s.loopWG.Go(func() {
		p.kv.runScraper(ctx, s.probe, p.Instances, sc.scrape, sc.scrapeTimeout, sc.scrapePath)
	})
}

// TokenSource is the pool's token source for requests that carry no token
// ids (nil when the pool has none): the gRPC Index.Lookup tokenizes prompts
// with it exactly as kv_aware does.
func (st *KVState) TokenSource() TokenSource {
	if st == nil {
		return nil
	}
	return st.tokens
}
