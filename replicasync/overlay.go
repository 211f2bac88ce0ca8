package replicasync

import (
	"slices"

	"github.com/kvrouter/kvrouter/kvindex"
)

// Effect is what a peer's decision of the epoch being decided does, as
// this replica computed it from the peer's intent (kvaware's
// DecideIntent): one request in flight on Instance, its prefill pending
// (Pending: routing time and the tokens it computes, drained by Rate as
// the peers' are), and its blocks about to be computed there (Keys,
// counted as a peer's speculative blocks).
type Effect struct {
	Instance string
	Pending  Pending
	Rate     int64
	Keys     []kvindex.Key
}

// overlay is the effects of the epoch's peers' intents decided so far. It
// counts as one more live peer until ClearOverlay, when the epoch is
// decided: the peers' real state arrives by the sync, and an overlay kept
// past the epoch would count those requests twice.
type overlay struct {
	loads map[string]Load
	held  map[kvindex.Key][]string // block → instances it is about to be computed on
}

// Overlay adds a peer's decision of the epoch being decided to what the
// peers' state counts (PeerLoad, PeerQueue, PeerExtend, PeerHolders), until
// ClearOverlay.
func (t *Table) Overlay(e Effect) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ov.loads == nil {
		t.ov.loads, t.ov.held = map[string]Load{}, map[kvindex.Key][]string{}
	}
	l := t.ov.loads[e.Instance]
	l.Instance = e.Instance
	l.InFlight++
	if e.Pending.Tokens > 0 {
		l.PendingTokens += e.Pending.Tokens
		l.PendingRequests++
		l.Pending = append(l.Pending, e.Pending)
		if e.Rate > 0 {
			l.Rate = e.Rate
		}
	}
	t.ov.loads[e.Instance] = l
	for _, k := range e.Keys {
		if h := t.ov.held[k]; !slices.Contains(h, e.Instance) {
			t.ov.held[k] = append(h, e.Instance)
		}
	}
}

// ClearOverlay forgets the epoch's overlay.
func (t *Table) ClearOverlay() {
	t.mu.Lock()
	defer t.mu.Unlock()
	clear(t.ov.loads)
	clear(t.ov.held)
}

// OverlayLen is how many effects' instances the overlay holds (tests).
func (t *Table) OverlayLen() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.ov.loads)
}

// overlayExtend is how far the overlay's blocks continue keys on inst
// from block from.
func (t *Table) overlayExtend(keys []kvindex.Key, from int, inst string) int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if len(t.ov.held) == 0 {
		return from
	}
	for from < len(keys) && slices.Contains(t.ov.held[keys[from]], inst) {
		from++
	}
	return from
}

// overlayHolders appends the instances the overlay holds key on.
func (t *Table) overlayHolders(dst []string, key kvindex.Key) []string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, in := range t.ov.held[key] {
		if !slices.Contains(dst, in) {
			dst = append(dst, in)
		}
	}
	return dst
}
