package kvaware

import (
	"context"
	"slices"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
)

// Sequencing a same-instant burst (replicasync/sequence.go,
// docs/replicas.md "Sequencing a burst"): when an epoch is due, a replica
// decides the epoch's intents in the pool's order — its own through Pick,
// as always, and each peer's dry (DecideIntent), whose effects count as a
// peer's state on a throwaway overlay until the epoch is decided
// (EndEpoch). Its own decisions change its real state as any decision
// does; its peers' real effects arrive by the sync, after the overlay is
// gone, so nothing counts twice.

// SequencePeers is the part of the peer state a sequenced replica needs:
// the epoch's overlay. *replicasync.Table and *replicasync.Syncer
// implement it.
type SequencePeers interface {
	Overlay(replicasync.Effect)
	ClearOverlay()
}

var _ SequencePeers = (*replicasync.Syncer)(nil)

// intentKeys is a peer's prompt as its intent describes it: its length
// and leading block keys (the request's KeyMemo, read by evaluate).
type intentKeys struct {
	keys   []kvindex.Key
	tokens int
}

// Intent describes req for the peers: its prompt's length, routing hash
// and leading block keys as this replica keys them (kept in req, so that
// its pick does not key the prompt again). Without token ids or a block
// size it carries the length alone, and every replica decides it as this
// one will, heuristically.
func (s *KVAware) Intent(ctx context.Context, req *router.Request) replicasync.Intent {
	st := s.st
	in := replicasync.Intent{Hash: req.RoutingHash(), RemotePrefill: req.RemotePrefill}
	if req.Tokenizer == nil {
		req.Tokenizer = st.tokens
	}
	ids, err := req.TokenIDs(ctx)
	if err != nil {
		return in
	}
	ids = ids[:min(len(ids), maxKeyedTokens)]
	in.Tokens = len(ids)
	bs := s.sc.blockSize
	if bs <= 0 {
		bs = st.index.BlockSize()
	}
	if bs <= 0 || len(ids) < bs {
		return in
	}
	root := kvindex.Root(st.model, req.Adapter, req.CacheSalt())
	keys := kvindex.AppendKeys(nil, root, ids, bs)
	req.KeyMemo = &keyMemo{keys: keys, root: root, bs: bs, n: len(ids)}
	in.Keys = make([]uint64, min(len(keys), replicasync.MaxIntentKeys))
	for i := range in.Keys {
		in.Keys[i] = uint64(keys[i])
	}
	return in
}

// DecideIntent decides a peer's intent dry, as the peer will decide it
// for real, and adds what that decision does (a request in flight, its
// pending prefill, its blocks about to be computed; and a warm-up copy's)
// to the epoch's overlay, for the epoch's later intents to see. It
// commits nothing of this replica's own. Without replica sync (no overlay
// to add to) it only decides.
func (s *KVAware) DecideIntent(ctx context.Context, in *replicasync.Intent, warmable bool, cands []*router.Instance) (router.Decision, error) {
	st := s.st
	keys := make([]kvindex.Key, len(in.Keys))
	for i, k := range in.Keys {
		keys[i] = kvindex.Key(k)
	}
	req := &router.Request{KeyMemo: &intentKeys{keys: keys, tokens: in.Tokens}, Warmable: warmable && !in.RemotePrefill,
		RemotePrefill: in.RemotePrefill} // a decode pick's edge sends no copy (router.Request.ProxyCanWarm)
	req.SetRoutingHash(in.Hash)
	dec, ev, err := s.pick(ctx, req, cands, false)
	if err != nil {
		return dec, err
	}
	defer st.putEval(ev)
	sp, ok := st.peers.ps.(SequencePeers)
	if !ok {
		return dec, nil
	}
	at := st.now().UnixNano()
	// effect is ce computing the prompt's first end blocks, tokens tokens,
	// of which it holds hit, as commit counts it (speculate, the observer).
	effect := func(ce *candEval, end, tokens, hit int) replicasync.Effect {
		e := replicasync.Effect{Instance: ce.inst.ID()}
		if ev.tokens == 0 {
			return e
		}
		if !ev.remote {
			// A decode pick (RemotePrefill) computes none of the prompt:
			// no pending prefill, as commit books none; its blocks are
			// about to be held there all the same.
			e.Pending = replicasync.Pending{At: at, Tokens: int64(max(tokens-hit, 0))}
			e.Rate = st.publishedRate()
		}
		if g := ce.blocks[tiers.GPU]; g < end && s.spec != nil {
			e.Keys = slices.Clone(ev.keys[g:end])
		}
		return e
	}
	if ce := ev.find(dec.Instance); ce != nil {
		sp.Overlay(effect(ce, len(ev.keys), ev.tokens, ce.held()))
	} else {
		sp.Overlay(replicasync.Effect{Instance: dec.Instance.ID()})
	}
	if ev.rent.warm {
		// The copy is of the prefix bought, not the whole prompt.
		blocks, n, held := ev.warmCopy()
		sp.Overlay(effect(&ev.cands[ev.rent.warmAt], blocks, n, held))
	}
	return dec, nil
}

// EndEpoch forgets the epoch's overlay: the epoch is decided.
func (st *KVState) EndEpoch() {
	if sp, ok := st.peers.ps.(SequencePeers); ok {
		sp.ClearOverlay()
	}
}
