package kvindex

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
)

// Several routers share one Redis index and all consume the same stream.
// Each stream message must change the index once, whichever router gets
// there first, and the per-instance counters must follow the map exactly.
// Three things make that so, all kept in the instance's own map key (one
// key, so one Cluster slot, and one atomic script):
//
//   - a position "#s": the stream sequence of the last message applied to
//     the instance. A router applies a message only when the map is at the
//     position the router expects (its previous message of the instance);
//     at or past the message it skips it (another router applied it);
//     anywhere else the map missed messages (a writer died, Redis lost
//     data) and the router repairs it first (ApplyAt returns SeqBehind).
//     A map without a position was never seeded, or Redis lost it.
//   - a writer lease "#o"/"#x": one router at a time writes an instance,
//     so block-key writes (other keys, other slots: they cannot join the
//     script) are never reordered between two writers. The lease is taken
//     in the read round trip and renewed by every commit; when its router
//     dies another takes over once it has expired (the consumer yields to
//     the last writer first: ApplyAtYielding).
//   - counters "#n", "#t0".."#t3" adjusted by the script from the values it
//     replaces, not from deltas computed on an earlier read: they equal the
//     map's contents whatever the interleaving, and are never negative.

// DefaultWriterLease is how long a router keeps the right to write an
// instance of a shared Redis index after its last write. It must outlast
// one Apply (a read, the events applied in memory, a pipelined write:
// milliseconds, a big snapshot load tens of them) by a wide margin, and it
// bounds how long the index lags the stream for an instance whose writing
// router died: others take over once it has expired, at their next
// message or when one they left to that router (ApplyAtYielding) is still
// missing a check interval later. Two seconds is well over the first, and
// under the consumers' default MaxLag (5s).
const DefaultWriterLease = 2 * time.Second

// Position is where an instance's state in a shared index stands: the
// stream sequence of the last message applied. Seeded is false for an
// instance whose map holds no position: never loaded, or lost by Redis.
//
// Hole (0: none) is a hole pending in the instance's state: the stream
// sequence of the first message after messages of the instance the stream
// lost, applied (ApplyAtHole) over a state that did not hold what they
// did. Every router reads it, and the instance is not whole until a
// snapshot at or past it is loaded (LoadAt) or a message after it that
// clears the instance's cache (AllBlocksCleared) is applied: both remove
// it. It is kept in the instance's map with the position (the same key,
// written by the same script).
type Position struct {
	Seq    uint64
	Seeded bool
	Hole   uint64
}

func (p Position) String() string {
	if !p.Seeded {
		return "unseeded"
	}
	if p.Hole != 0 {
		return strconv.FormatUint(p.Seq, 10) + " (hole at " + strconv.FormatUint(p.Hole, 10) + ")"
	}
	return strconv.FormatUint(p.Seq, 10)
}

// at reports whether p and q are the same position, holes aside.
func (p Position) at(q Position) bool { return p.Seq == q.Seq && p.Seeded == q.Seeded }

// SeqStatus says what ApplyAt or LoadAt did.
type SeqStatus uint8

const (
	// SeqApplied: the events were applied and the position moved to seq.
	SeqApplied SeqStatus = iota + 1
	// SeqDuplicate: the instance is already at or past seq (another
	// router applied it): nothing written.
	SeqDuplicate
	// SeqNotOwner: another router holds the instance's writer lease and
	// keeps it current: nothing written.
	SeqNotOwner
	// SeqBehind: the instance is not at the expected position (Position
	// says where it is): messages are missing, nothing written. The caller
	// re-applies the missing ones or reloads the instance, then retries.
	SeqBehind
	// SeqYielded (ApplyAtYielding only): another router wrote the instance
	// last and its lease has run out: it normally applies this message
	// too, so it is left to it, as with SeqNotOwner; nothing written. A
	// caller that finds the message still missing later applies it with
	// ApplyAt, which takes the instance over.
	SeqYielded
)

func (s SeqStatus) String() string {
	switch s {
	case SeqApplied:
		return "applied"
	case SeqDuplicate:
		return "duplicate"
	case SeqNotOwner:
		return "not_owner"
	case SeqBehind:
		return "behind"
	case SeqYielded:
		return "yielded"
	}
	return "unknown"
}

// SeqResult is what ApplyAt or LoadAt did and where the instance stands.
type SeqResult struct {
	ApplyResult
	Status SeqStatus
	// Position is the instance's position after the call (SeqApplied), or
	// the one found (the other statuses).
	Position Position
	// Takeover (SeqApplied by ApplyAt): the instance was last written by
	// another router (or this one before a restart), so this write started
	// a new incarnation, rewriting the whole map it held (see Redis.apply;
	// not a new instance's first write, nor a write carrying a clear).
	Takeover bool
}

// errLeaseTooOld: the read round trip is older than half the lease, so
// another router may have taken the instance over: nothing was written.
var errLeaseTooOld = errors.New("kvindex: redis: writer lease may have expired before the write")

// errMoved: the instance's lease or position changed between Apply's read
// and its write (Redis restarted empty, the instance was purged).
var errMoved = errors.New("kvindex: redis: instance map changed under the write")

// seqGuard is what ApplyAt and LoadAt ask of the instance map.
type seqGuard struct {
	from Position // the expected position (Seeded false: unknown, never matches)
	load bool     // LoadAt: any position below seq; the state is replaced
	seq  uint64   // the new position
	// yield (ApplyAtYielding): leave the instance to the writer whose
	// lease ran out rather than take it over.
	yield bool
	// hole (ApplyAtHole): the message at seq is the first past a hole
	// its state does not reach: recorded in the map (Position.Hole).
	hole bool
}

// holeArg is the commit's hole argument for a guarded write of evs: "c"
// when the events clear the instance (a pending hole at or before seq is
// removed), seq when the message is applied over a hole (recorded), ""
// otherwise. A load removes a hole at or before seq in any case.
func (g *seqGuard) holeArg(evs []events.Event) string {
	if g == nil || g.load {
		return ""
	}
	for i := range evs {
		if evs[i].Kind == events.AllBlocksCleared {
			return "c"
		}
	}
	if g.hole {
		return strconv.FormatUint(g.seq, 10)
	}
	return ""
}

// expected renders the expected position for the script: "*" any, "!"
// unknown (never equal to a stored position), else the decimal sequence.
func (g *seqGuard) expected() string {
	switch {
	case g.load:
		return "*"
	case !g.from.Seeded:
		return "!"
	}
	return strconv.FormatUint(g.from.Seq, 10)
}

// ApplyAt applies one stream message's events (stream sequence seq) to the
// instance if the instance's state is at from: see Position. Concurrent
// calls from several routers for the same message apply it once. An error
// means Redis could not be read or written; the state may then hold part
// of the message, and the caller should reload the instance.
func (r *Redis) ApplyAt(ctx context.Context, instance string, from Position, seq uint64, evs []events.Event) (SeqResult, error) {
	return r.apply(ctx, instance, &seqGuard{from: from, seq: seq}, evs)
}

// ApplyAtHole is ApplyAt (ApplyAtYielding when yield) for the first
// message of the instance after a hole in its engine seqs (messages the
// stream lost) that the instance's state in the index does not reach: the
// hole is recorded in the instance's map with the write, atomically, so
// that every router reads the instance not whole (Position.Hole) until a
// snapshot at or past seq is loaded or a clear after it applied.
func (r *Redis) ApplyAtHole(ctx context.Context, instance string, from Position, seq uint64, yield bool, evs []events.Event) (SeqResult, error) {
	return r.apply(ctx, instance, &seqGuard{from: from, seq: seq, yield: yield, hole: true}, evs)
}

// ApplyAtYielding is ApplyAt, except that an instance another router
// wrote last is left to it even once its lease has run out (SeqYielded):
// every router applies every message, and after an instance was silent
// for longer than the lease the first to reach Redis would otherwise take
// it over, which costs a rewrite of the instance (a takeover starts a new
// incarnation: see Redis.apply). The consumer applies a message this way
// first and, when the message is still missing a check interval later or
// the index misses an earlier one (the writer died or stalled), takes the
// instance over with ApplyAt.
func (r *Redis) ApplyAtYielding(ctx context.Context, instance string, from Position, seq uint64, evs []events.Event) (SeqResult, error) {
	return r.apply(ctx, instance, &seqGuard{from: from, seq: seq, yield: true}, evs)
}

// LoadAt replaces the instance's state with evs (a snapshot of its blocks
// current to stream sequence seq) and moves its position to seq, unless
// the instance is already at or past seq (SeqDuplicate) or another router
// holds its writer lease (SeqNotOwner).
//
// A snapshot at the instance's own position is taken while a hole is
// pending at or below it (Position.Hole): the bridge's table at that
// stream seq holds what the messages the stream lost did, and an engine
// gone quiet after the hole has no newer one to offer. The load removes
// the hole, so a second one there (another router's) is a duplicate;
// without a hole a load at the position is one too (nothing to repair,
// no rewrite of the instance).
func (r *Redis) LoadAt(ctx context.Context, instance string, seq uint64, evs []events.Event) (SeqResult, error) {
	return r.apply(ctx, instance, &seqGuard{load: true, seq: seq}, evs)
}

// WriterLease is the configured writer lease (RedisConfig.WriterLease).
func (r *Redis) WriterLease() time.Duration { return r.lease }

// Position returns where the instance's state stands.
//
// An instance this process left unsettled (see unsettle) is marked first:
// its state is not known, and reads as unseeded.
func (r *Redis) Position(ctx context.Context, instance string) (Position, error) {
	mkey := r.metaKey(instID(instance))
	if m := r.maps.peek(instance); m != nil {
		if err := r.settle(ctx, m, mkey); err != nil {
			return Position{}, err
		}
	}
	v, err := r.rdb.HMGet(ctx, mkey, fieldPos, fieldTopology, fieldHole).Result()
	if err != nil {
		return Position{}, r.failed(fmt.Errorf("kvindex: redis: position of %s: %w", instance, err))
	}
	return r.position(v), nil
}

// position reads an HMGET of fieldPos, fieldTopology, fieldHole: a
// position stamped under another Cluster topology does not count (see
// topology).
func (r *Redis) position(v []any) Position {
	s, _ := v[0].(string)
	e, _ := v[1].(string)
	if e != r.topology() {
		return Position{}
	}
	p := parsePosition(s)
	if h, _ := v[2].(string); p.Seeded && h != "" {
		p.Hole, _ = strconv.ParseUint(h, 10, 64)
	}
	return p
}

// Positions returns several instances' positions, in one pipelined round
// trip.
func (r *Redis) Positions(ctx context.Context, instances []string) ([]Position, error) {
	pipe := r.rdb.Pipeline()
	cmds := make([]*redis.SliceCmd, len(instances))
	for i, inst := range instances {
		cmds[i] = pipe.HMGet(ctx, r.metaKey(instID(inst)), fieldPos, fieldTopology, fieldHole)
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, r.failed(fmt.Errorf("kvindex: redis: positions: %w", err))
	}
	out := make([]Position, len(instances))
	for i, c := range cmds {
		if v, err := c.Result(); err == nil {
			out[i] = r.position(v)
		}
	}
	return out, nil
}

// parsePosition parses a position as mapScript returns it: the sequence,
// then, when a hole is pending, a space and the hole's.
func parsePosition(s string) Position {
	s, hole, _ := strings.Cut(s, " ")
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return Position{}
	}
	h, _ := strconv.ParseUint(hole, 10, 64)
	return Position{Seq: v, Seeded: true, Hole: h}
}

// Epoch returns the index's epoch: a random value stored under
// <prefix>:v3:m the first time it is asked for. It changes only when Redis
// loses it (restarted without persistence, flushed, failed over to a
// replica that never had it), which is how a router learns that every
// instance must be checked and reloaded; created reports that this call
// stored it.
//
// A router that has no block size yet (none configured, no event seen: it
// started while the pool is idle) also learns it here, from <prefix>:bs,
// which the first router to learn one stores.
func (r *Redis) Epoch(ctx context.Context) (epoch string, created bool, err error) {
	if r.bs.get() == 0 {
		if n, err := r.rdb.Get(ctx, r.bsKey()).Int(); err == nil && n > 0 {
			r.bs.learned.CompareAndSwap(0, int64(n))
		}
	}
	if err := r.refreshTopology(ctx); err != nil {
		return "", false, err
	}
	topo := r.topology()
	mine := newToken()
	old, err := r.rdb.SetArgs(ctx, r.epochKey(), mine, redis.SetArgs{Mode: "NX", Get: true}).Result()
	if errors.Is(err, redis.Nil) {
		return mine + topo, true, nil
	}
	if err != nil {
		return "", false, r.failed(fmt.Errorf("kvindex: redis: epoch: %w", err))
	}
	// The client sends the command again after a read timeout (a hung
	// server): an earlier copy of this call may have stored the value
	// this one finds. Drawn at random per call, it is then this call's.
	return old + topo, old == mine, nil
}

// rewindTTL is how long a check counter (Rewound) outlives the last check
// that counted it: far over any check interval, so a running router's
// counter never expires, and a stopped router's goes on its own.
const rewindTTL = time.Hour

// Rewound reports whether Redis went back in time since the last call of
// this handle that answered: restarted from its own persistence (an RDB
// snapshot, an AOF not fsynced at every write) to an earlier point. The
// epoch survives such a restart, so only the server can tell, and a
// restart between two checks that no call saw fail leaves nothing else to
// see it by. Each call runs checkScript on every server it checks: it
// increments a counter of this handle's own, <prefix>:v3:n:<token>, kept a
// rewindTTL after its last increment, and returns the server's run_id
// (INFO server: a random value drawn at every start, which Redis Sentinel
// and Cluster use to tell a restarted node). A changed run_id is a
// restart, and a restart is taken as a rewind whatever the counter says:
// the writes between the server's last persistence point (its last RDB
// save, its AOF's last fsync) and its death are lost, and the last check's
// increment may well be older than that point, so the counter alone misses
// every loss shorter than a check interval — the usual one, an AOF fsynced
// every second losing its last second. A counter not above the value the
// last call got (gone: it starts again at 1) is a rewind too, which covers
// a server whose INFO is not allowed (renamed, or a proxy's): its run_id
// reads "" and only the counter tells (INFO is then left out of the
// checks for infoRetry). A call whose reply is lost after the increment
// ran makes the next one skip a value, never repeat one. The first call
// reports false. A restart that lost nothing is reported
// too: it cannot be told from one that lost what was written since its
// persistence point, and the answer costs a read of the positions (one
// Redis) or a reload of the pool (a Cluster), as an outage or a failover
// does.
//
// On a Redis Cluster every master is checked, each through a key in a
// slot it serves (rewindChecks): a master restarted from its own
// persistence inside cluster-node-timeout keeps its node id, so neither
// the topology nor the epoch changes, and what it lost (block keys among
// them) is missing while instance positions on other masters say it was
// applied. Positions cannot tell, so a master found rewound moves the
// index's rewind generation (<prefix>:v3:g, a new random value, as an INCR
// on a master that lost its last increments could repeat an old one),
// which is part of the topology every position is stamped with: every
// position stamped before it stops counting and the epoch changes, so the
// consumers reload every instance from its snapshot, as after a failover.
// What a master answered is kept by its node id, and the script returns
// the id of the node that ran it: a replica promoted in its place is a
// new master, first seen, not a rewind, even when the client reaches it
// before the checks' slot map shows the failover (the failover changes
// the topology, and so the epoch, by itself). The generation moves only
// from the value this handle last read (a compare-and-set), so routers
// that find the same rewind move it once; a rewind found is reported
// until the generation has moved. A master that does not answer is
// skipped (what it last answered kept, so a restart or a rewind is seen
// when it answers again); the call fails only when none answers or the
// generation cannot be moved.
func (r *Redis) Rewound(ctx context.Context) (bool, error) {
	_, cluster := r.rdb.(*redis.ClusterClient)
	checks := []rewindCheck{{key: r.ns + "n:" + r.token}}
	if cluster {
		var err error
		if checks, err = r.rewindChecks(ctx); err != nil {
			return false, err
		}
	}
	back, err := r.countRewound(ctx, checks)
	if err != nil || !cluster {
		return back, err
	}
	r.rewind.mu.Lock()
	r.rewind.pending = r.rewind.pending || back
	pending, read := r.rewind.pending, r.rewind.gen
	r.rewind.mu.Unlock()
	if !pending {
		return false, nil
	}
	if err := moveGenScript.Run(ctx, r.rdb, []string{r.genKey()}, read, newToken()).Err(); err != nil {
		return false, r.failed(fmt.Errorf("kvindex: redis: rewind generation: %w", err))
	}
	r.rewind.mu.Lock()
	r.rewind.pending = false
	r.rewind.mu.Unlock()
	return true, nil
}

// moveGenScript sets the rewind generation (KEYS[1]) to ARGV[2] when it
// still holds ARGV[1], the value the caller last read ("" for none):
// another router that found the same rewind has moved it already
// otherwise.
var moveGenScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if (cur == false and ARGV[1] == '') or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
`)

// checkScript increments the check counter KEYS[1], sets it to expire in
// ARGV[1] ms, and returns {count, run_id, node id}: the run_id from INFO
// server when ARGV[2] is "1", the Cluster node id (CLUSTER MYID) when
// ARGV[3] is "1", each "" when not asked or refused (pcall: a renamed or
// refused command must not fail the check). It runs on the server that
// holds KEYS[1], so both are that server's. Sent as EVAL: once a check per
// master, it is not worth EVALSHA's NOSCRIPT path.
const checkScript = `
local n = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
local run, id = '', ''
if ARGV[2] == '1' then
  local ok, info = pcall(redis.call, 'INFO', 'server')
  if ok and type(info) == 'string' then
    run = string.match(info, 'run_id:(%w+)') or ''
  end
end
if ARGV[3] == '1' then
  local ok, me = pcall(redis.call, 'CLUSTER', 'MYID')
  if ok and type(me) == 'string' then
    id = me
  end
end
return {n, run, id}
`

// infoRetry is how long a handle refused INFO (or, on a Cluster, CLUSTER
// MYID) leaves it out of its checks before it asks again. Redis logs every refusal (ACL LOG) and counts it
// (INFO errorstats), once per check per router per master: asking a few
// times an hour keeps those quiet for an operator's alerts, and still
// picks up a user granted INFO later without a restart.
const infoRetry = 5 * time.Minute

// rewindCheck is one server Rewound checks: its counter key, and the
// master's node id on a Cluster ("" off one).
type rewindCheck struct {
	key, master string
}

// rewindSeen is what a server answered Rewound last: its counter, the key
// it was counted in, its run_id and (on a Cluster) its node id.
type rewindSeen struct {
	key   string
	count int64
	run   string
	node  string
}

// countRewound runs checkScript on every server in one pipeline (on a
// Cluster split per master, sent in parallel) and reports whether one that
// answered restarted or went back since this handle's last call it
// answered; an error only when none answered. On a Cluster an answer from
// another node than the master a check is for is not compared: the client
// followed a failover or a resharding (its slot map reloads every second)
// that the slot map the checks were built from (the last epoch check's)
// does not show yet, and a promoted replica is a new master, first seen
// at the next check (the failover changes the epoch by itself).
// rewindChecks drops what a node no longer a master answered.
func (r *Redis) countRewound(ctx context.Context, checks []rewindCheck) (bool, error) {
	_, cluster := r.rdb.(*redis.ClusterClient)
	now := time.Now()
	r.rewind.mu.Lock()
	askInfo, askID := now.After(r.rewind.infoOff), cluster && now.After(r.rewind.idOff)
	r.rewind.mu.Unlock()
	ttl, info, myid := rewindTTL.Milliseconds(), "0", "0"
	if askInfo {
		info = "1"
	}
	if askID {
		myid = "1"
	}
	res := make([]*redis.Cmd, len(checks))
	_, perr := r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, c := range checks {
			res[i] = p.Eval(ctx, checkScript, []string{c.key}, ttl, info, myid)
		}
		return nil
	})
	r.rewind.mu.Lock()
	defer r.rewind.mu.Unlock()
	if r.rewind.seen == nil {
		r.rewind.seen = map[string]rewindSeen{}
	}
	back, answered, hidden := false, false, !askInfo
	for i, c := range checks {
		got, err := parseCheck(res[i], c.key)
		if err != nil {
			continue // not answering: what it last answered kept
		}
		answered = true
		if askID && got.node == "" {
			// CLUSTER MYID refused: answers are compared whichever node
			// gave them, so a failover may read as a rewind (one more
			// reload of the pool) until it is allowed.
			r.rewind.idOff = now.Add(infoRetry)
		}
		if got.node != "" && c.master != "" && got.node != c.master {
			continue // another node answered for this master
		}
		if askInfo && got.run == "" {
			hidden = true
			r.rewind.infoOff = now.Add(infoRetry)
		}
		last, ok := r.rewind.seen[c.master]
		counted := ok && last.key == got.key && got.count <= last.count
		restarted := ok && last.run != "" && got.run != "" && got.run != last.run
		if !askInfo && !counted {
			// Not asked: the last run_id stands, so a restart in the
			// meantime is seen once INFO is asked again; unless the
			// counter has just reported one, which that would report
			// a second time.
			got.run = last.run
		}
		r.rewind.seen[c.master] = got
		back = back || counted || restarted
	}
	if !answered {
		return false, r.failed(fmt.Errorf("kvindex: redis: check counter: %w", cmp.Or(perr, errors.New("no answer"))))
	}
	r.rewind.hidden = hidden
	return back, nil
}

// RestartsUnseen reports whether the last Rewound that answered found a
// server whose INFO this client may not run (an ACL without +info, a
// renamed command), or left INFO out after such a refusal (infoRetry):
// there the counter alone tells, and a restart that loses only writes
// newer than the last check is not seen (Rewound).
func (r *Redis) RestartsUnseen() bool {
	r.rewind.mu.Lock()
	defer r.rewind.mu.Unlock()
	return r.rewind.hidden
}

// parseCheck reads checkScript's reply to a check of key.
func parseCheck(c *redis.Cmd, key string) (rewindSeen, error) {
	v, err := c.Slice()
	if err != nil {
		return rewindSeen{}, err
	}
	if len(v) != 3 {
		return rewindSeen{}, fmt.Errorf("kvindex: redis: check reply of %d values", len(v))
	}
	n, ok := v[0].(int64)
	run, ok2 := v[1].(string)
	node, ok3 := v[2].(string)
	if !ok || !ok2 || !ok3 {
		return rewindSeen{}, fmt.Errorf("kvindex: redis: check reply %T, %T, %T", v[0], v[1], v[2])
	}
	return rewindSeen{key: key, count: n, run: run, node: node}, nil
}

// rewindChecks returns one check per Cluster master, its counter key
// hashing (by its {tag}) to a slot the master serves (the start of its
// widest range), kept while the master serves that slot. The slot map is
// the one refreshTopology last read (the epoch check's, a check ago),
// read now only before the first.
func (r *Redis) rewindChecks(ctx context.Context) ([]rewindCheck, error) {
	if r.slots.Load() == nil {
		if err := r.refreshTopology(ctx); err != nil {
			return nil, err
		}
	}
	slots := *r.slots.Load()
	widest := map[string]redis.ClusterSlot{} // master id → its widest range
	for _, s := range slots {
		if len(s.Nodes) == 0 {
			continue
		}
		if f, ok := widest[s.Nodes[0].ID]; !ok || s.End-s.Start > f.End-f.Start {
			widest[s.Nodes[0].ID] = s
		}
	}
	serves := func(id string, slot int) bool {
		for _, s := range slots {
			if len(s.Nodes) > 0 && s.Nodes[0].ID == id && slot >= s.Start && slot <= s.End {
				return true
			}
		}
		return false
	}
	tags := slotTags()
	r.rewind.mu.Lock()
	defer r.rewind.mu.Unlock()
	if r.rewind.keys == nil {
		r.rewind.keys = map[string]rewindKey{}
	}
	for id := range r.rewind.keys {
		if _, ok := widest[id]; !ok {
			// No longer a master: its key and what it answered go.
			delete(r.rewind.keys, id)
			delete(r.rewind.seen, id)
		}
	}
	checks := make([]rewindCheck, 0, len(widest))
	for id, s := range widest {
		k, ok := r.rewind.keys[id]
		if !ok || !serves(id, k.slot) {
			k = rewindKey{key: r.ns + "n:" + r.token + ":{" + tags[s.Start] + "}", slot: s.Start}
			r.rewind.keys[id] = k
		}
		checks = append(checks, rewindCheck{key: k.key, master: id})
	}
	slices.SortFunc(checks, func(a, b rewindCheck) int { return strings.Compare(a.key, b.key) })
	return checks, nil
}

// keySlot is the Redis Cluster slot of a hash tag's content: CRC16 (the
// XMODEM variant: polynomial 0x1021, initial value 0) modulo 16,384, as
// the Redis Cluster specification defines it ("Key distribution model").
func keySlot(tag string) int {
	var crc uint16
	for i := range len(tag) {
		crc ^= uint16(tag[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) & 16383
}

// slotTags returns, for every Cluster slot, a short hash tag that hashes
// to it (keySlot), built once: base-36 numbers in order until every slot
// has one (about 170,000 of them).
var slotTags = sync.OnceValue(func() *[16384]string {
	var tags [16384]string
	for n, left := uint64(0), 16384; left > 0; n++ {
		t := strconv.FormatUint(n, 36)
		if s := keySlot(t); tags[s] == "" {
			tags[s] = t
			left--
		}
	}
	return &tags
})

// rewindKey is a master's check counter key and its slot.
type rewindKey struct {
	key  string
	slot int
}

// rewindState is Rewound's: what each server answered last (by master
// node id; "" off a Cluster), on a Cluster each master's counter key, the
// rewind generation as last read (refreshTopology), whether a rewind
// was found that has not moved it yet, and whether the last check met a
// server that hid its run_id (RestartsUnseen).
type rewindState struct {
	mu      sync.Mutex
	hidden  bool
	infoOff time.Time // INFO left out of the checks until then (infoRetry)
	idOff   time.Time // CLUSTER MYID left out until then (infoRetry)
	seen    map[string]rewindSeen
	keys    map[string]rewindKey // by master node id
	gen     string
	pending bool
}

// On a Redis Cluster, a failover loses the writes the old master had not
// replicated yet (replication is asynchronous): block keys anywhere may
// miss recent placements while every instance's position, on another
// master, says they were applied. Nothing in the data tells, so the
// topology does: the masters' node ids per slot range, hashed. A guarded
// write stamps the topology it saw on the instance (#e); once the masters
// change, a position stamped under the old ones does not count (Position
// reports the instance unseeded, ApplyAt answers behind) and the epoch
// changes, so the consumers reload every instance from its snapshot
// (LoadAt rewrites every block it holds) and replay the stream after it.
// A failover, and a resharding, cost a reload of the pool; a replica that
// restarts or joins does not.

// topology is the Cluster topology as last seen ("" off a Cluster).
func (r *Redis) topology() string {
	if p := r.topo.Load(); p != nil {
		return *p
	}
	return ""
}

// refreshTopology reads the Cluster's slot map (one CLUSTER SLOTS) and
// updates topology; off a Cluster it does nothing.
func (r *Redis) refreshTopology(ctx context.Context) error {
	cc, ok := r.rdb.(*redis.ClusterClient)
	if !ok {
		return nil
	}
	slots, err := cc.ClusterSlots(ctx).Result() // any node's view: they agree within a gossip round
	if err != nil || len(slots) == 0 {
		return r.failed(fmt.Errorf("kvindex: redis: cluster slots: %w", err))
	}
	r.slots.Store(&slots)
	ranges := make([]string, 0, len(slots))
	for _, s := range slots {
		if len(s.Nodes) > 0 {
			ranges = append(ranges, fmt.Sprintf("%d-%d:%s", s.Start, s.End, s.Nodes[0].ID))
		}
	}
	slices.Sort(ranges)
	// The rewind generation (Rewound) is part of it: a master that went
	// back in time unstamps every position, as a failover does.
	gen, err := r.rdb.Get(ctx, r.genKey()).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return r.failed(fmt.Errorf("kvindex: redis: rewind generation: %w", err))
	}
	r.rewind.mu.Lock()
	r.rewind.gen = gen
	r.rewind.mu.Unlock()
	in := strings.Join(ranges, ",")
	if gen != "" { // none ever set: the stamp of the releases before it, so a rolling upgrade keeps every position
		in += "|" + gen
	}
	t := fmt.Sprintf("/%016x", xxhash.Sum64String(in))
	r.topo.Store(&t)
	return nil
}

func (r *Redis) epochKey() string { return r.ns + "m" }
func (r *Redis) bsKey() string    { return r.ns + "bs" }
func (r *Redis) genKey() string   { return r.ns + "g" }

func newToken() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Instance metadata fields of the shared protocol (the others are in
// redis.go).
const (
	fieldTopology   = "#e"
	fieldPos        = "#s"
	fieldOwner      = "#o"
	fieldOwnerUntil = "#x"
	// fieldWriter: the lease token of the writer whose commit made the
	// instance's current state, cleared when another writer takes the
	// lease (see takeover in Redis.apply).
	fieldWriter = "#w"
	// fieldHole: a pending hole's stream sequence (Position.Hole).
	fieldHole = "#h"
)

// mapScript is the only writer of an instance's metadata hash (KEYS[1])
// and engine-hash log (KEYS[2]), both on the instance's slot.
//
//	ARGV[1] mode: "b" (begin: check and take the lease, read the log
//	        unless ARGV[6] is current), "y" (the same, but an expired
//	        lease of another writer is left to it: "yield") or "c" (commit)
//	ARGV[2] lease token, "" = unguarded (plain Apply: no lease, no position)
//	ARGV[3] lease ms
//	ARGV[4] expected position: "*" any, "!" none matches, else a sequence
//	ARGV[5] new position (a sequence; "" = unguarded)
//	ARGV[6] the generation of the caller's copy of the map ("" = none)
//	commit: ARGV[7] the new generation; ARGV[8] "a" append ARGV[9] to the
//	        log (a list of chunks of records), "w" replace the log with
//	        it; ARGV[10..14] the counters
//	        #n, #t0..#t3 after the change; ARGV[15] the instance's name;
//	        ARGV[16] the instance's field id (see fieldIDs); ARGV[17]
//	        the hole (#h, guarded writes): "c" the events clear the
//	        instance, so a hole at or before the new position is gone
//	        (as with a load, ARGV[4] "*"), a sequence: record a hole
//	        there (seqGuard.holeArg); a write over an unseeded map
//	        forgets one (the state is reloaded)
//	last: the caller's view of the Cluster's topology (see topology);
//	        a guarded write stamps it (#e), and a position stamped under
//	        another topology does not count: the instance is unseeded
//
// A position is returned as "seq" or, a hole pending (#h), "seq hole".
// It returns {status, position or nil, generation, field id, mine[, log]}
// (mine: "1" when the caller's token made the last guarded commit (#w)
// and nobody took the lease since (a begin that takes it from another
// writer, or from none, clears #w), "" otherwise: a takeover; the log
// whenever the
// metadata has no generation: the metadata was lost while the log was
// not, and the caller must see what the log holds) (the begin; the
// commit, which records the caller's token in #w: {status, position or
// nil, generation}), status "ok",
// "dup" (already at or past the new position; a load, ARGV[4] "*", at
// the position itself is taken while a hole (#h) is pending at or below
// it: see LoadAt), "owned" (another router's
// lease), "yield" (mode "y": another router's lease, run out), "behind" (not at the expected position) or "stale" (commit: the
// caller's map is not the current one). The begin returns the log when
// the caller's generation is not current. The commit checks the lease,
// the position and the generation again, so counters computed from the
// caller's map apply to exactly the state they were computed from, or not
// at all.
var mapScript = redis.NewScript(`
local m, l = KEYS[1], KEYS[2]
local guarded = ARGV[2] ~= ''
local begin = ARGV[1] ~= 'c'
local pos = false
local topo = ARGV[#ARGV]
local rp = false -- the position as returned: with the hole pending, if any
if guarded then
  local st = redis.call('HMGET', m, '#s', '#e', '#h')
  pos = st[1]
  if pos and (st[2] or '') ~= topo then pos = false end
  rp = pos
  if pos and st[3] then rp = pos .. ' ' .. st[3] end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local o = redis.call('HMGET', m, '#o', '#x')
  -- At or past the new position: another router applied it, or loaded
  -- past it. A load (ARGV[4] '*') at the position itself is taken while
  -- a hole is pending at or below it (#h): the snapshot there holds what
  -- the lost messages did. Once it has removed the hole, another load at
  -- the position is a duplicate again.
  if pos and tonumber(pos) >= tonumber(ARGV[5]) and not (ARGV[4] == '*' and st[3]
      and tonumber(pos) == tonumber(ARGV[5]) and tonumber(st[3]) <= tonumber(pos)) then
    return {'dup', rp}
  end
  if begin then
    if o[1] and o[1] ~= ARGV[2] then
      if tonumber(o[2] or '0') > now then return {'owned', rp} end
      if ARGV[1] == 'y' then return {'yield', rp} end
    end
    -- Taken from another writer (or none): whatever the state, it is no
    -- longer this writer's own until it commits a new incarnation.
    if o[1] ~= ARGV[2] then redis.call('HDEL', m, '#w') end
  elseif o[1] ~= ARGV[2] then
    return {'owned', rp}
  end
  redis.call('HSET', m, '#o', ARGV[2], '#x', now + tonumber(ARGV[3]))
  if ARGV[4] ~= '*' and pos ~= ARGV[4] then return {'behind', rp} end
end
local gen = redis.call('HGET', m, '#g') or ''
if begin then
  local fid = redis.call('HGET', m, '#f') or ''
  local mine = ''
  if guarded and redis.call('HGET', m, '#w') == ARGV[2] then mine = '1' end
  if gen == ARGV[6] and gen ~= '' then return {'ok', rp, gen, fid, mine} end
  return {'ok', rp, gen, fid, mine, redis.call('LRANGE', l, 0, -1)}
end
if gen ~= ARGV[6] then return {'stale', rp, gen} end
if ARGV[8] == 'w' then redis.call('DEL', l) end
if ARGV[9] ~= '' then redis.call('RPUSH', l, ARGV[9]) end
redis.call('HSET', m, '#g', ARGV[7], '#n', ARGV[10], '#t0', ARGV[11], '#t1', ARGV[12], '#t2', ARGV[13], '#t3', ARGV[14], '#name', ARGV[15], '#f', ARGV[16])
if guarded then
  redis.call('HSET', m, '#s', ARGV[5], '#e', topo, '#w', ARGV[2])
  local h = redis.call('HGET', m, '#h')
  if h and (not pos or (ARGV[17] == 'c' or ARGV[4] == '*') and tonumber(ARGV[5]) >= tonumber(h)) then
    redis.call('HDEL', m, '#h')
    h = false
  end
  if ARGV[17] ~= '' and ARGV[17] ~= 'c' then
    redis.call('HSET', m, '#h', ARGV[17])
    h = ARGV[17]
  end
  if h then return {'ok', ARGV[5] .. ' ' .. h, ARGV[7]} end
else
  redis.call('HDEL', m, '#w')
end
return {'ok', guarded and ARGV[5] or false, ARGV[7]}
`)

// regScript writes an instance's registry entry (KEYS[1] the registry,
// ARGV[1] the instance id, ARGV[2] the entry, ARGV[3] the name, ARGV[4]
// the entry's field id and ARGV[5] the one the writer replaces, both in
// hex) unless the id is another name's — then it returns {'name', that
// name} — or the entry names a third field id: another writer moved the
// instance on (this write is a late one, and must not point lookups back
// at retired fields) or the registry lost a write (a Cluster failover);
// then it returns {'fid', that id} and the caller, once its commit is
// known to have applied, runs it again with that id as the one it
// replaces (a compare-and-set still: see Redis.apply). Nothing is written
// in either case.
var regScript = redis.NewScript(`
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v then
  local sp = string.find(v, ' ', 1, true) or #v
  local sp2 = string.find(v, ' ', sp + 1, true) or #v
  local name = string.sub(v, sp2 + 1)
  if name ~= ARGV[3] then return {'name', name} end
  local cur = string.sub(v, sp + 1, sp2 - 1)
  if cur ~= ARGV[4] and cur ~= ARGV[5] then return {'fid', cur} end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {}
`)

// delIfScript deletes field ARGV[1] of KEYS[1] if it holds ARGV[2].
var delIfScript = redis.NewScript(`
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
`)

// loadScripts loads the backend's scripts into Redis (every master of a
// Cluster).
func (r *Redis) loadScripts(ctx context.Context) error {
	if err := mapScript.Load(ctx, r.rdb).Err(); err != nil {
		return err
	}
	if err := delIfScript.Load(ctx, r.rdb).Err(); err != nil {
		return err
	}
	return regScript.Load(ctx, r.rdb).Err()
}

// pipelined runs fn's commands in one pipeline; when Redis does not have
// mapScript cached (a restarted or new server answers EVALSHA with
// NOSCRIPT) it loads it and runs the pipeline once more: fn must queue
// commands that are safe to repeat (the failed EVALSHA changed nothing,
// and the other commands write the same values again).
func (r *Redis) pipelined(ctx context.Context, fn func(redis.Pipeliner)) ([]redis.Cmder, error) {
	do := func(p redis.Pipeliner) error { fn(p); return nil }
	cmds, err := r.rdb.Pipelined(ctx, do)
	if err == nil || !hasNoScript(cmds) {
		return cmds, err
	}
	if err := r.loadScripts(ctx); err != nil {
		return cmds, fmt.Errorf("load script: %w", err)
	}
	return r.rdb.Pipelined(ctx, do)
}

func hasNoScript(cmds []redis.Cmder) bool {
	for _, c := range cmds {
		if err := c.Err(); err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			return true
		}
	}
	return false
}

// scriptStatus parses a mapScript reply's status and position.
func scriptStatus(reply []any) (SeqStatus, Position, error) {
	if len(reply) < 1 {
		return 0, Position{}, errors.New("kvindex: redis: empty script reply")
	}
	var pos Position
	if len(reply) > 1 {
		if s, ok := reply[1].(string); ok {
			pos = parsePosition(s)
		}
	}
	switch reply[0] {
	case "ok":
		return SeqApplied, pos, nil
	case "dup":
		return SeqDuplicate, pos, nil
	case "owned":
		return SeqNotOwner, pos, nil
	case "yield":
		return SeqYielded, pos, nil
	case "behind":
		return SeqBehind, pos, nil
	case "stale":
		return 0, pos, fmt.Errorf("%w: the cached engine-hash map is not the current one", errMoved)
	}
	return 0, pos, fmt.Errorf("kvindex: redis: script status %v", reply[0])
}

// failed is the backend's error path: on a Redis Cluster it also asks the
// client to reload the slot map in the background, since go-redis learns
// a failover only from a MOVED reply or its periodic refresh, and a
// client without retries (the consumer repairs instead) would otherwise
// keep dialling a dead master's address for that long.
func (r *Redis) failed(err error) error {
	if cc, ok := r.rdb.(*redis.ClusterClient); ok {
		cc.ReloadState(context.Background())
	}
	return err
}
