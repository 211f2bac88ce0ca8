package workload

import (
	"fmt"
	"slices"
	"sort"
	"time"
)

// Replication makes a workload for a fleet n times larger from one sized
// for a small fleet: n disjoint copies played at once. Each copy keeps the
// original's shape exactly (prefix tree, lengths, arrival pattern, turn
// order) but shares nothing with the others, so the per-instance load, the
// per-instance working set and the pooled-cache bound (hit rate) are those
// of the original on a fleet n times as large.
//
// Copies start at different phases: copy k is shifted by k/n of the
// original's typical gap between distinct arrival times. The copies are
// independent user populations, whose relative phase is arbitrary; starting
// them all at once would align their bursts into bursts n times larger
// than anything in the original, and shifting by whole gaps would be an
// arbitrary choice too, while a uniform phase over one gap keeps the
// original's burst size and spreads the copies' bursts evenly.

// ReplicateTrace returns n disjoint copies of recs, merged by time: copy k
// offsets every hash id by k × the ids' span (largest − min(smallest, 0) +
// 1: for ids >= 0, the largest id + 1) and shifts timestamps by k × gap / n
// ms (gap: the median positive gap between consecutive timestamps). Copies
// whose ids would overflow int64 are refused. n = 1 returns recs itself.
// The result is sorted by timestamp (stable: a copy's records keep their
// order).
func ReplicateTrace(recs []TraceRecord, n int) ([]TraceRecord, error) {
	out, _, err := ReplicateTraceSources(recs, n)
	return out, err
}

// ReplicateTraceSources is ReplicateTrace with, for each record returned,
// the index in recs of the record it copies.
func ReplicateTraceSources(recs []TraceRecord, n int) ([]TraceRecord, []int, error) {
	if n < 1 {
		return nil, nil, fmt.Errorf("%w: replicate %d: want >= 1", ErrInvalid, n)
	}
	if n == 1 || len(recs) == 0 {
		src := make([]int, len(recs))
		for i := range src {
			src[i] = i
		}
		return recs, src, nil
	}
	var minID, maxID int64
	ts := make([]float64, len(recs))
	for i, r := range recs {
		for _, h := range r.HashIDs {
			minID, maxID = min(minID, h), max(maxID, h)
		}
		ts[i] = float64(r.Timestamp)
	}
	// Copy k's ids lie in [minID + k·span, maxID + k·span]: disjoint ranges.
	span, ok := maxID-minID, maxID-minID >= maxID // minID <= 0
	if ok {
		span, ok = addInt64(span, 1)
	}
	if ok {
		last, okm := mulInt64(span, int64(n-1))
		_, oka := addInt64(maxID, last)
		ok = okm && oka
	}
	if !ok {
		return nil, nil, fmt.Errorf("%w: replicate %d: hash ids span [%d, %d]: %d disjoint copies overflow int64", ErrInvalid, n, minID, maxID, n)
	}
	gap := typicalGap(ts)
	out := make([]TraceRecord, 0, len(recs)*n)
	src := make([]int, 0, len(recs)*n)
	for k := range n {
		off := int64(k) * span
		shift := int64(float64(k) * gap / float64(n))
		for i, r := range recs {
			c := r
			c.Timestamp += shift
			c.HashIDs = make([]int64, len(r.HashIDs))
			for j, h := range r.HashIDs {
				c.HashIDs[j] = h + off
			}
			out = append(out, c)
			src = append(src, i)
		}
	}
	order := make([]int, len(out))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(i, j int) bool { return out[order[i]].Timestamp < out[order[j]].Timestamp })
	sorted, from := make([]TraceRecord, len(out)), make([]int, len(out))
	for i, k := range order {
		sorted[i], from[i] = out[k], src[k]
	}
	return sorted, from, nil
}

// addInt64 is a + b, and whether it fits.
func addInt64(a, b int64) (int64, bool) {
	s := a + b
	return s, (b >= 0) == (s >= a)
}

// mulInt64 is a × b for a, b >= 0, and whether it fits.
func mulInt64(a, b int64) (int64, bool) {
	if a == 0 || b == 0 {
		return 0, true
	}
	p := a * b
	return p, p/b == a && p >= 0
}

// typicalGap is the median positive gap between consecutive sorted times
// (0 when all are equal).
func typicalGap(times []float64) float64 {
	s := slices.Clone(times)
	sort.Float64s(s)
	var gaps []float64
	for i := 1; i < len(s); i++ {
		if d := s[i] - s[i-1]; d > 0 {
			gaps = append(gaps, d)
		}
	}
	if len(gaps) == 0 {
		return 0
	}
	sort.Float64s(gaps)
	return Quantile(gaps, 0.5)
}

// Replicate returns n disjoint copies of an open-loop workload merged by
// time (see ReplicateTrace for why): copy k's segments get seeds of their
// own (so its prompts share no token with another copy's), its sessions
// and tenants are prefixed "r<k>/", its arrivals are shifted by k/n of the
// typical gap between arrivals, and scale events add or remove n times as
// many instances. n = 1 returns w itself.
func Replicate(w *Workload, n int) (*Workload, error) {
	if n < 1 {
		return nil, fmt.Errorf("%w: replicate %d: want >= 1", ErrInvalid, n)
	}
	if n == 1 {
		return w, nil
	}
	if w.ClosedLoop > 0 {
		return nil, fmt.Errorf("%w: replicate: workload %q is closed-loop", ErrInvalid, w.Name)
	}
	ts := make([]float64, len(w.Requests))
	for i := range w.Requests {
		ts[i] = float64(w.Requests[i].At)
	}
	gap := typicalGap(ts)
	out := &Workload{Name: w.Name, Requests: make([]Request, 0, len(w.Requests)*n)}
	for k := range n {
		shift := time.Duration(float64(k) * gap / float64(n))
		salt := derive(uint64(k), "replica", uint64(k))
		for _, r := range w.Requests {
			c := r
			c.At += shift
			if k > 0 {
				c.Prompt = make([]Segment, len(r.Prompt))
				for j, sg := range r.Prompt {
					sg.Seed ^= salt
					c.Prompt[j] = sg
				}
				if c.Session != "" {
					c.Session = fmt.Sprintf("r%d/%s", k, c.Session)
				}
				if c.Tenant != "" {
					c.Tenant = fmt.Sprintf("r%d/%s", k, c.Tenant)
				}
			}
			out.Requests = append(out.Requests, c)
		}
	}
	for _, ev := range w.Fleet {
		ev.Instances *= n
		out.Fleet = append(out.Fleet, ev)
	}
	return out.finish(), nil
}
