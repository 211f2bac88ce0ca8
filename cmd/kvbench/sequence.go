package main

// des --routers R --sequence δ: the replicas sequence same-instant bursts
// (replicasync.Sequencer, kvaware's Intent/DecideIntent; docs/replicas.md
// "Sequencing a burst"). The balancer hands each arrival to a replica at
// once; the replica holds it until its epoch is due and publishes its
// intent, delivered to the peers --sync-latency later. When an epoch is
// due, every replica decides the epoch's intents in the pool's order: its
// own for real (the driver's Pick), its peers' dry onto its overlay. The
// replicaSet is the driver's Admission: a held request waits there.

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/workload"
)

// sequencing is a replicaSet's sequencing state (nil when off).
type sequencing struct {
	set       *replicaSet
	prefixLen int
	salt      bool
	// seqs is each replica's Sequencer; due is each replica's intents of
	// the epoch being decided, in the pool's order, and at its cursor.
	seqs []*replicasync.Sequencer
	due  [][]replicasync.Intent
	at   []int
	// held maps a held request to its owner's intent until its Pick; ids
	// maps an intent back to its request.
	held    map[uint64]replicasync.Intent
	ids     map[intentID]uint64
	transit []intentDelivery
	ready   []uint64 // ids admitted now, in the pool's order
	open    bool     // an epoch's overlays may hold effects
	// agreed and probes count how often a peer's dry decision of an
	// intent was the owner's real one.
	agreed, probes int
	dry            []string // per replica: its dry pick of the intent being decided
}

type intentID struct {
	replica string
	seq     uint64
}

type intentDelivery struct {
	at time.Duration
	to int
	in replicasync.Intent
}

func newSequencing(n int, delta, grace time.Duration, ff *fleetFlags) *sequencing {
	q := &sequencing{prefixLen: ff.prefixLen, salt: ff.salt, held: map[uint64]replicasync.Intent{}, ids: map[intentID]uint64{},
		due: make([][]replicasync.Intent, n), at: make([]int, n), dry: make([]string, n)}
	if q.prefixLen == 0 {
		q.prefixLen = 8192 // the driver's default
	}
	for i := range n {
		q.seqs = append(q.seqs, replicasync.NewSequencer(replicasync.SequencerConfig{
			Replica: fmt.Sprintf("r%d", i), Epoch: delta, Grace: grace, Start: epoch}))
	}
	return q
}

var _ des.Admission = (*sequencing)(nil)

// assign is the balancer's choice of replica for a new request.
func (s *replicaSet) assign() int {
	i := s.next
	if s.random != nil {
		i = s.random.IntN(len(s.reps))
	} else {
		s.next = (s.next + 1) % len(s.reps)
	}
	return i
}

// Arrive hands request id to a replica, which holds it for its epoch when
// a peer is live (and publishes its intent), or routes it at once.
func (q *sequencing) Arrive(id uint64, req *workload.Request, now time.Duration) (bool, string) {
	s := q.set
	i := s.assign()
	s.owner[id] = i
	rep := s.reps[i]
	kv, ok := rep.s.(*kvaware.KVAware)
	if !ok || rep.peers == nil {
		return true, ""
	}
	salt := ""
	if q.salt {
		salt = req.Tenant
	}
	rr := &des.RouteRequest{Request: req, Tokens: req.AppendTokens(nil), RoutingText: req.TextPrefix(q.prefixLen), Now: now, CacheSalt: salt, EngineID: id}
	in := kv.Intent(context.Background(), rep.request(rr))
	in, held := q.seqs[i].Hold(s.wall(), rep.peers.Table.Live() > 0, in)
	if !held {
		return true, ""
	}
	q.held[id] = in
	q.ids[intentID{in.Replica, in.Seq}] = id
	for j := range s.reps {
		if j != i {
			q.transit = append(q.transit, intentDelivery{at: now + s.latency, to: j, in: in})
		}
	}
	return false, ""
}

// deliver hands the peers the intents due by now (clock, before anything
// at now is decided).
func (q *sequencing) deliver(now time.Duration) {
	n := 0
	for _, d := range q.transit {
		if d.at > now {
			q.transit[n] = d
			n++
			continue
		}
		q.seqs[d.to].Receive(epoch.Add(d.at), d.in)
	}
	q.transit = q.transit[:n]
}

// Admitted releases the held requests of every epoch due by now, in the
// pool's order; each replica's list of the epoch's intents (own and
// peers') is kept for Pick, which decides the peers' dry in turn.
func (q *sequencing) Admitted(now time.Duration, dst []uint64) []uint64 {
	s := q.set
	var own []replicasync.Intent
	for i, sq := range q.seqs {
		list := sq.Due(s.wall(), nil)
		if len(list) == 0 {
			continue
		}
		// The overlays hold effects until the clock moves on (endEpoch).
		q.due[i], q.open = append(q.due[i], list...), true
		for _, in := range list {
			if in.Replica == sq.Name() {
				own = append(own, in)
			}
		}
	}
	slices.SortFunc(own, replicasync.Order)
	for _, in := range own {
		dst = append(dst, q.ids[intentID{in.Replica, in.Seq}])
	}
	return dst
}

func (q *sequencing) Shed(_ time.Duration, dst []des.Dropped) []des.Dropped { return dst }

// NextExpiry is when the next epoch is due at any replica.
func (q *sequencing) NextExpiry() (time.Duration, bool) {
	var t time.Duration
	found := false
	for _, sq := range q.seqs {
		if at, ok := sq.Next(); ok {
			if d := at.Sub(epoch); !found || d < t {
				t, found = d, true
			}
		}
	}
	return t, found
}

func (q *sequencing) FirstToken(uint64, time.Duration)        {}
func (q *sequencing) Finished(uint64, time.Duration)          {}
func (q *sequencing) Companion(uint64, string, time.Duration) {}

// sequenced decides on every replica, dry and in the pool's order, the
// epoch's peers' intents up to held (the owner's intent of the request
// about to be picked; the other replicas decide that one dry too): what
// each replica does at the epoch's end before it dispatches that request.
// Each replica's own intents are decided for real by the driver's Picks,
// in the same order.
func (q *sequencing) sequenced(ctx context.Context, held replicasync.Intent, cands []string) {
	for j, rep := range q.set.reps {
		q.dry[j] = ""
		kv, ok := rep.s.(*kvaware.KVAware)
		if !ok {
			continue
		}
		var insts []*router.Instance
		for ; q.at[j] < len(q.due[j]); q.at[j]++ {
			in := &q.due[j][q.at[j]]
			if replicasync.Order(*in, held) > 0 {
				break
			}
			if in.Replica == q.seqs[j].Name() {
				continue // its own: decided for real by its Pick
			}
			if insts == nil {
				insts = rep.candidates(cands)
				rep.loadScrape()
			}
			d, err := kv.DecideIntent(ctx, in, true, insts)
			if err == nil && in.Replica == held.Replica && in.Seq == held.Seq {
				q.dry[j] = d.Instance.ID()
			}
		}
	}
}

// candidates is the replica's instances for the driver's names.
func (r *replica) candidates(names []string) []*router.Instance {
	out := make([]*router.Instance, 0, len(names))
	for _, c := range names {
		if in, err := r.instance(c); err == nil {
			out = append(out, in)
		}
	}
	return out
}

// endEpoch forgets every replica's overlay once the epoch's instant has
// passed (clock): the peers' real effects come by the sync.
func (s *replicaSet) endEpoch() {
	q := s.seq
	if q == nil || !q.open {
		return
	}
	for i, rep := range s.reps {
		if rep.kv != nil {
			rep.kv.state.EndEpoch()
		}
		q.due[i], q.at[i] = q.due[i][:0], 0
	}
	q.open = false
}

// compare counts the other replicas' dry decisions of the request the
// owner (replica i) just decided for real as inst.
func (q *sequencing) compare(i int, inst string) {
	for j, d := range q.dry {
		if j == i || d == "" {
			continue
		}
		q.probes++
		if d == inst {
			q.agreed++
		}
	}
}

// String is the sequencing line of the report.
func (q *sequencing) String() string {
	var st replicasync.SequencerStats
	for _, sq := range q.seqs {
		x := sq.Stats()
		st.Held, st.Alone, st.Received, st.Late, st.Dropped = st.Held+x.Held, st.Alone+x.Alone, st.Received+x.Received, st.Late+x.Late, st.Dropped+x.Dropped
	}
	agree := "no peer decisions"
	if q.probes > 0 {
		agree = fmt.Sprintf("%.2f%% of %d", 100*float64(q.agreed)/float64(q.probes), q.probes)
	}
	return fmt.Sprintf("held %d, alone %d; peers' intents sequenced %d, late %d, over the bound %d; a peer's dry decision = the owner's: %s",
		st.Held, st.Alone, st.Received, st.Late, st.Dropped, agree)
}
