// Package replicasync shares, between the router replicas of one pool,
// what only a router knows: the requests it has in flight on each
// instance, the prefill tokens it has sent there that have not started
// producing output, and its speculative blocks (a prompt's blocks counted
// as held by the instance it was just routed to, before the engine's
// events confirm them). Each replica publishes its own state on a NATS
// core subject and adds its peers' to its own; there is no coordinator and
// nothing durable: a replica that joins asks (a hello) and every peer
// answers with its whole state, and a replica that stops publishing stops
// counting after PeerTimeout.
//
// The wire format is versioned binary (see Message); docs/replicas.md
// describes the protocol and when to use it.
package replicasync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
)

// Version is the wire format's version. A message of a newer version is
// counted and dropped: replicas of different versions each route on their
// own counters rather than misread each other's. Version 2 adds to each
// load entry the sender's prefill rate and its pending requests (routing
// time and tokens), so that every replica drains every replica's pending
// prefill by the same model from the same facts; a version 1 message is
// still read (its entries carry neither: their pending prefill counts in
// full, as version 1 replicas count it). Version 3 adds the sender's
// requests that recently ended on the instance (routing and end time), so
// that every replica can take out of an engine-load sample, scraped at its
// own moment, the requests any replica saw end since (docs/replicas.md);
// a version 2 message is read as listing none. Version 4 adds the
// placement message (KindPlacement: the sender's mean tokens computed per
// pick and its averaged predicted queue per instance, from which every
// replica computes kv_aware's placement term alike); load, spec and hello
// messages are unchanged and still go out as version 3, so that a version
// 3 peer keeps reading them and drops only the placement messages.
// Version 5 adds the rent message (KindRent: the sender's rent-or-buy
// accounts of hot prefixes, from which every replica sums the pool's
// account alike); the other kinds go out as before, so that a version 3
// or 4 peer drops only the rent messages. Version 6 adds the intent
// message (KindIntent: requests the sender holds for their sequencing
// epoch, sequence.go); the other kinds go out as before. Version 7 adds
// the commit message (KindCommit: the highest intent seq whose request the
// sender has decided for real, sent after the load and spec messages that
// carry those decisions' effects, so that a peer that begins deciding an
// epoch late does not count them again on its overlay); the other kinds go
// out as before. Version 8 adds the remote-prefill flag of the intent
// message (flag bit 1, flagRemotePrefill: its intents are disaggregated
// requests' decode picks, which book no pending prefill); intent messages
// still go out as version 6, since a version 6 or 7 decoder reads the
// flags' bit 0 only: an older peer reads them as before, ignoring the bit.
const Version = 8

// version is the version m goes out as: the oldest that carries its kind.
func (m *Message) version() byte {
	switch m.Kind {
	case KindPlacement:
		return 4
	case KindRent:
		return 5
	case KindIntent:
		return 6
	case KindCommit:
		return 7
	}
	return 3
}

// minVersion is the oldest version Decode reads.
const minVersion = 1

// magic starts every message, so that stray traffic on the subject is told
// apart from a version mismatch.
var magic = [3]byte{'K', 'R', 'S'}

// Kind is what a message carries.
type Kind uint8

const (
	// KindLoad carries per-instance load counters.
	KindLoad Kind = 1
	// KindSpec carries speculative blocks.
	KindSpec Kind = 2
	// KindHello asks every peer to publish its whole state now.
	KindHello Kind = 3
	// KindPlacement carries the sender's placement averages (version 4).
	KindPlacement Kind = 4
	// KindRent carries the sender's rent accounts (version 5).
	KindRent Kind = 5
	// KindIntent carries requests the sender holds for their sequencing
	// epoch (version 6).
	KindIntent Kind = 6
	// KindCommit carries the highest intent seq whose request the sender
	// has decided for real (version 7).
	KindCommit Kind = 7
)

func (k Kind) String() string {
	switch k {
	case KindLoad:
		return "load"
	case KindSpec:
		return "spec"
	case KindHello:
		return "hello"
	case KindPlacement:
		return "placement"
	case KindRent:
		return "rent"
	case KindIntent:
		return "intent"
	case KindCommit:
		return "commit"
	}
	return "unknown"
}

// Limits on what a message may hold; Decode refuses more.
const (
	// MaxNameLen bounds a replica or instance name (as events.MaxTokenLen).
	MaxNameLen = 128
	// MaxEntries bounds the entries of one message.
	MaxEntries = 1 << 16
	// MaxTTL bounds a speculative block's announced lifetime.
	MaxTTL = 10 * time.Minute
)

// Errors of Decode.
var (
	ErrMagic     = errors.New("replicasync: not a replica sync message")
	ErrVersion   = errors.New("replicasync: unsupported version")
	ErrMalformed = errors.New("replicasync: malformed message")
)

// Load is one instance's counters as the sending replica sees them.
type Load struct {
	Instance string
	// InFlight is requests sent and not finished.
	InFlight int64
	// PendingTokens and PendingRequests are prefill sent and not started
	// (no first response byte yet).
	PendingTokens   int64
	PendingRequests int64
	// Rate is the sender's prefill rate (tokens/s) by which it drains its
	// pending prefill, 0 if unknown (version 1).
	Rate int64
	// Started is when the sender last saw a first byte from the instance
	// (Unix ns, its clock; 0 none): the engine's queue was past that
	// request's prefill by then, so pending work starts no earlier.
	Started int64
	// Pending lists the sender's pending requests on the instance, oldest
	// first, at most MaxPending; PendingTokens beyond their sum are
	// unlisted and count in full.
	Pending []Pending
	// Ended lists the sender's requests that ended on the instance
	// recently (version 3), at most MaxEnded, the newest.
	Ended []Ended
}

// Ended is one request that ended on an instance: when it was routed and
// when its response ended (the sender's clock, Unix ns; End >= At).
type Ended struct {
	At, End int64
}

// MaxEnded bounds the ended requests listed per load entry: the newest
// are listed (a receiver needs those that ended after its latest
// engine-load sample); beyond them a sample counts in full, as before
// version 3.
const MaxEnded = 64

// sinceSent is l as a delta after prev was sent for the same instance:
// Ended holds only the ends added since (the list grows at its end), so
// that an end goes out once per heartbeat rather than with every change
// of the instance's counters; the receiver merges them into what it holds
// (Table.ApplyLoad). The whole list when prev's newest end is no longer in
// it, or when the delta would otherwise say the instance holds nothing.
func (l Load) sinceSent(prev []Ended) Load {
	if len(prev) == 0 || len(l.Ended) == 0 {
		return l
	}
	i := slices.Index(l.Ended, prev[len(prev)-1])
	if i < 0 {
		return l
	}
	d := l
	d.Ended = l.Ended[i+1:]
	if d.Empty() {
		d.Ended = l.Ended
	}
	return d
}

// mergeEnded is held followed by the ends of add that held does not list
// (a delta sent again after a failed send), the newest MaxEnded (a new
// slice). Equal ends within add are distinct requests (routed and ended
// at the same instant): both count.
func mergeEnded(held, add []Ended) []Ended {
	if len(add) == 0 {
		return held
	}
	out := make([]Ended, 0, len(held)+len(add))
	out = append(out, held...)
	for _, e := range add {
		if !slices.Contains(held, e) {
			out = append(out, e)
		}
	}
	return out[max(len(out)-MaxEnded, 0):]
}

// Empty reports whether l carries nothing: no load and no recent end. A
// sender leaves such an instance out of its whole table; a receiver
// forgets its entry.
func (l *Load) Empty() bool {
	return l.InFlight == 0 && l.PendingTokens == 0 && l.PendingRequests == 0 && len(l.Ended) == 0
}

// Pending is one request routed to an instance whose first byte has not
// arrived: when it was routed (the sender's clock, Unix ns) and its
// prefill tokens.
type Pending struct {
	At     int64
	Tokens int64
}

// MaxPending bounds the pending requests listed per load entry: the oldest
// are listed (they decide when the queue's work ends), the rest count in
// full.
const MaxPending = 64

// Equal reports whether l and o carry the same values.
func (l Load) Equal(o Load) bool {
	if l.Instance != o.Instance || l.InFlight != o.InFlight || l.PendingTokens != o.PendingTokens ||
		l.PendingRequests != o.PendingRequests || l.Rate != o.Rate || l.Started != o.Started {
		return false
	}
	return slices.Equal(l.Pending, o.Pending) && slices.Equal(l.Ended, o.Ended)
}

// Spec is one routing decision's speculative blocks: Keys counted as held
// by Instance for TTL from receipt.
type Spec struct {
	Instance string
	TTL      time.Duration
	Keys     []uint64
}

// Message is one published message.
type Message struct {
	Kind Kind
	// Replica names the sender; Incarnation is random per process start,
	// so that a restarted replica's new counters replace, not add to, the
	// old ones.
	Replica     string
	Incarnation uint64
	// Seq increases with every load message of one incarnation; an older
	// one arriving late is dropped.
	Seq uint64
	// Complete: Loads is the sender's whole table (instances absent hold
	// nothing). Otherwise Loads updates the listed instances only.
	Complete bool
	Loads    []Load
	Specs    []Spec
	// Computed and Queues are a placement message's (KindPlacement):
	// the sender's mean tokens a pick makes its instance compute (0:
	// not measured yet) and its averaged predicted queue per instance.
	// Complete: Queues lists every instance the sender averages;
	// otherwise it adds to (replaces the listed of) the previous.
	Computed float64
	Queues   []Queued
	// Rents is a rent message's (KindRent) accounts. Complete: every
	// account the sender holds (those absent it holds none of);
	// otherwise the listed accounts replace what the sender said of
	// them before.
	Rents []Rent
	// Intents is an intent message's (KindIntent) held requests, each
	// the sender's (Intent.Replica and Incarnation are the message's on
	// decoding).
	Intents []Intent
	// Committed is a commit message's (KindCommit): the highest seq of
	// the sender's intents whose requests it has decided for real; their
	// effects are in the load and spec messages it sent before this one.
	Committed uint64
}

// Rent is the sender's rent-or-buy account of one prefix (kv_aware's
// hot-prefix replication, router/kvaware/replicate.go): the purchases of
// a copy the pool has made of it as far as the sender knows (Gen) and the
// rent the sender itself has paid on it since the last of them (seconds).
// Gen 0 with Rent 0 says the sender holds no account for Key any more.
type Rent struct {
	Key  uint64
	Gen  uint64
	Rent float64
}

// MaxRent bounds a rent account on the wire and in a sum (seconds). An
// account is the waiting a prefix's requests have paid since its last
// copy; once it reaches the price of a copy (a score difference: seconds
// of prefill and of the delay of the requests behind it, far below an
// hour) the prefix buys and the account starts again. 1e9 s (32 years)
// is far above anything an account can reach, and far enough below the
// largest float64 that sums of many stay finite: a peer's rent above it
// is refused, and a sum above it is MaxRent (two of 1e308 would be +Inf,
// and force a purchase).
const MaxRent = 1e9

// MaxRentGen bounds a rent account's generation (the purchases of copies
// of one prefix), as the decoder bounds every count: a purchase takes
// the next generation, which must not wrap to 0.
const MaxRentGen = 1 << 62

// MaxCounter bounds a load's counters and a pending request's or an
// intent's tokens on the wire (in flight, pending tokens and requests,
// prefill rate in tokens/s): 2^40, ~1.1e12, is far beyond any of them (a
// trillion requests in flight on one instance; a prefill queue of a
// trillion tokens, months of an engine's work; the longest prompts are
// ~1e7 tokens, a fast engine's prefill ~1e5 tokens/s), and far enough
// below 2^63 that sums of many stay positive (64 listed requests of a peer
// 2^46; the sums over peers, whose number a sender does not bound,
// saturate: AddSat). Times (Unix ns, up to 2^62) are not counters.
const MaxCounter = 1 << 40

// AddSat is a + b for non-negative a and b, at most math.MaxInt64.
func AddSat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// Removed reports whether r says the sender dropped its account.
func (r Rent) Removed() bool { return r.Gen == 0 && r.Rent == 0 }

// rentSize is a rent entry's size, at most.
const rentSize = 8 + binary.MaxVarintLen64 + 8

// Queued is one instance's predicted queue (seconds), averaged over time
// by the sender (kv_aware's W̄, router/kvaware/placement.go).
type Queued struct {
	Instance string
	Wait     float64
}

// placementValue reports whether v may go on the wire as a placement
// average: finite and not negative.
func placementValue(v float64) bool { return v >= 0 && !math.IsInf(v, 1) }

// rentValue reports whether r may go on the wire: a rent not negative
// and at most MaxRent, a generation at most MaxRentGen.
func rentValue(r Rent) bool { return r.Rent >= 0 && r.Rent <= MaxRent && r.Gen <= MaxRentGen }

// Flags (the header's flags byte). A decoder ignores the bits it does not
// know, so that a bit added later reaches older peers as the message
// without it.
const (
	flagComplete = 1
	// flagRemotePrefill (intent messages, version 8): every intent of the
	// message is a disaggregated request's decode pick
	// (Intent.RemotePrefill).
	flagRemotePrefill = 2
)

// remotePrefill is the intents' common RemotePrefill; ok is false when
// they differ (one flag carries it for the whole message).
func remotePrefill(ins []Intent) (remote, ok bool) {
	for i := range ins {
		if ins[i].RemotePrefill != ins[0].RemotePrefill {
			return false, false
		}
	}
	return len(ins) > 0 && ins[0].RemotePrefill, true
}

// header: magic, version, kind, flags, replica (len + bytes),
// incarnation (8 bytes), seq (uvarint), entry count (uvarint).

// AppendBinary appends m's encoding to dst.
func (m *Message) AppendBinary(dst []byte) ([]byte, error) {
	if err := checkName("replica", m.Replica); err != nil {
		return dst, err
	}
	var flags byte
	if m.Complete {
		flags |= flagComplete
	}
	if m.Kind == KindIntent {
		remote, ok := remotePrefill(m.Intents)
		if !ok {
			return dst, fmt.Errorf("%w: intents of one message differ in remote prefill", ErrMalformed)
		}
		if remote {
			flags |= flagRemotePrefill
		}
	}
	dst = append(dst, magic[0], magic[1], magic[2], m.version(), byte(m.Kind), flags)
	dst = appendName(dst, m.Replica)
	dst = binary.BigEndian.AppendUint64(dst, m.Incarnation)
	dst = binary.AppendUvarint(dst, m.Seq)
	switch m.Kind {
	case KindLoad:
		dst = binary.AppendUvarint(dst, uint64(len(m.Loads)))
		for _, l := range m.Loads {
			if err := checkName("instance", l.Instance); err != nil {
				return dst, err
			}
			if !counter(l.InFlight) || !counter(l.PendingTokens) || !counter(l.PendingRequests) || !counter(l.Rate) || l.Started < 0 ||
				len(l.Pending) > MaxPending || len(l.Ended) > MaxEnded {
				return dst, fmt.Errorf("%w: negative counter, one above MaxCounter, or too many pending or ended for %s", ErrMalformed, l.Instance)
			}
			dst = appendName(dst, l.Instance)
			dst = binary.AppendUvarint(dst, uint64(l.InFlight))
			dst = binary.AppendUvarint(dst, uint64(l.PendingTokens))
			dst = binary.AppendUvarint(dst, uint64(l.PendingRequests))
			dst = binary.AppendUvarint(dst, uint64(l.Rate))
			dst = binary.AppendUvarint(dst, uint64(l.Started))
			dst = binary.AppendUvarint(dst, uint64(len(l.Pending)))
			for _, p := range l.Pending {
				if p.At < 0 || !counter(p.Tokens) {
					return dst, fmt.Errorf("%w: negative pending request, or above MaxCounter tokens, for %s", ErrMalformed, l.Instance)
				}
				dst = binary.AppendUvarint(dst, uint64(p.At))
				dst = binary.AppendUvarint(dst, uint64(p.Tokens))
			}
			dst = binary.AppendUvarint(dst, uint64(len(l.Ended)))
			for _, e := range l.Ended {
				if e.At < 0 || e.End < e.At {
					return dst, fmt.Errorf("%w: ended request before it was routed for %s", ErrMalformed, l.Instance)
				}
				dst = binary.AppendUvarint(dst, uint64(e.At))
				dst = binary.AppendUvarint(dst, uint64(e.End-e.At))
			}
		}
	case KindSpec:
		dst = binary.AppendUvarint(dst, uint64(len(m.Specs)))
		for _, s := range m.Specs {
			if err := checkName("instance", s.Instance); err != nil {
				return dst, err
			}
			dst = appendName(dst, s.Instance)
			dst = binary.AppendUvarint(dst, uint64(max(min(s.TTL, MaxTTL), 0)/time.Millisecond))
			dst = binary.AppendUvarint(dst, uint64(len(s.Keys)))
			for _, k := range s.Keys {
				dst = binary.LittleEndian.AppendUint64(dst, k)
			}
		}
	case KindHello:
		dst = binary.AppendUvarint(dst, 0)
	case KindCommit:
		dst = binary.AppendUvarint(dst, 1)
		dst = binary.AppendUvarint(dst, m.Committed)
	case KindPlacement:
		if !placementValue(m.Computed) {
			return dst, fmt.Errorf("%w: computed tokens %v", ErrMalformed, m.Computed)
		}
		dst = binary.AppendUvarint(dst, uint64(len(m.Queues)))
		dst = binary.BigEndian.AppendUint64(dst, math.Float64bits(m.Computed))
		for _, q := range m.Queues {
			if err := checkName("instance", q.Instance); err != nil {
				return dst, err
			}
			if !placementValue(q.Wait) {
				return dst, fmt.Errorf("%w: queue %v for %s", ErrMalformed, q.Wait, q.Instance)
			}
			dst = appendName(dst, q.Instance)
			dst = binary.BigEndian.AppendUint64(dst, math.Float64bits(q.Wait))
		}
	case KindRent:
		dst = binary.AppendUvarint(dst, uint64(len(m.Rents)))
		for _, r := range m.Rents {
			if !rentValue(r) {
				return dst, fmt.Errorf("%w: rent %v in generation %d on %x", ErrMalformed, r.Rent, r.Gen, r.Key)
			}
			dst = binary.LittleEndian.AppendUint64(dst, r.Key)
			dst = binary.AppendUvarint(dst, r.Gen)
			dst = binary.BigEndian.AppendUint64(dst, math.Float64bits(r.Rent))
		}
	case KindIntent:
		dst = binary.AppendUvarint(dst, uint64(len(m.Intents)))
		for _, in := range m.Intents {
			if in.Arrival < 0 || !counter(int64(in.Tokens)) || len(in.Keys) > MaxIntentKeys {
				return dst, fmt.Errorf("%w: intent %d: negative arrival, tokens negative or above MaxCounter, or %d keys", ErrMalformed, in.Seq, len(in.Keys))
			}
			dst = binary.AppendUvarint(dst, in.Seq)
			dst = binary.AppendUvarint(dst, uint64(in.Arrival))
			dst = binary.AppendVarint(dst, int64(in.Priority))
			dst = binary.AppendUvarint(dst, uint64(in.Tokens))
			dst = binary.LittleEndian.AppendUint64(dst, in.Hash)
			dst = binary.AppendUvarint(dst, uint64(len(in.Keys)))
			for _, k := range in.Keys {
				dst = binary.LittleEndian.AppendUint64(dst, k)
			}
		}
	default:
		return dst, fmt.Errorf("%w: kind %d", ErrMalformed, m.Kind)
	}
	return dst, nil
}

// Size of a load entry and of a spec entry's fixed part, at most: what a
// sender budgets per entry before encoding.
func loadSize(l Load) int {
	return 1 + len(l.Instance) + (7+2*len(l.Pending)+2*len(l.Ended))*binary.MaxVarintLen64
}
func specSize(s Spec) int {
	return 1 + len(s.Instance) + 2*binary.MaxVarintLen64 + 8*len(s.Keys)
}

// queuedSize is a placement entry's size.
func queuedSize(q Queued) int { return 1 + len(q.Instance) + 8 }

// headerSize is a message's header size, at most.
func headerSize(replica string) int { return 6 + 1 + len(replica) + 8 + 2*binary.MaxVarintLen64 }

func appendName(dst []byte, s string) []byte {
	dst = append(dst, byte(len(s)))
	return append(dst, s...)
}

// checkName accepts 1..MaxNameLen bytes of [A-Za-z0-9_-]: the characters
// of pool and instance names (events.ValidToken).
func checkName(what, s string) error {
	if len(s) == 0 || len(s) > MaxNameLen {
		return fmt.Errorf("%w: %s name of %d bytes", ErrMalformed, what, len(s))
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("%w: %s name %q", ErrMalformed, what, s)
		}
	}
	return nil
}

// Decode parses one message. It never panics and allocates in proportion
// to the input: counts are checked against the bytes left before any
// slice is made.
func Decode(b []byte) (Message, error) {
	var m Message
	if len(b) < 6 || b[0] != magic[0] || b[1] != magic[1] || b[2] != magic[2] {
		return m, ErrMagic
	}
	if b[3] < minVersion || b[3] > Version {
		return m, fmt.Errorf("%w: %d (this replica speaks %d to %d)", ErrVersion, b[3], minVersion, Version)
	}
	v := b[3]
	m.Kind, m.Complete = Kind(b[4]), b[5]&flagComplete != 0
	remote := m.Kind == KindIntent && b[5]&flagRemotePrefill != 0
	r := reader{b: b[6:]}
	m.Replica = r.name("replica")
	m.Incarnation = r.u64be()
	m.Seq = r.uvarint()
	n := r.uvarint()
	if r.err == nil && n > MaxEntries {
		r.fail("%d entries", n)
	}
	switch m.Kind {
	case KindLoad:
		if r.err == nil && n > uint64(len(r.b))/5 { // an entry is at least 5 bytes
			r.fail("%d load entries in %d bytes", n, len(r.b))
		}
		if r.err == nil && n > 0 {
			m.Loads = make([]Load, 0, n)
		}
		for i := uint64(0); i < n && r.err == nil; i++ {
			l := Load{Instance: r.name("instance")}
			l.InFlight, l.PendingTokens, l.PendingRequests = r.counter(), r.counter(), r.counter()
			if v >= 2 {
				l.Rate, l.Started = r.counter(), r.count()
				if k := r.pairs(MaxPending, "pending"); k > 0 {
					l.Pending = make([]Pending, k)
					for j := range l.Pending {
						l.Pending[j] = Pending{At: r.count(), Tokens: r.counter()}
					}
				}
			}
			if v >= 3 {
				if k := r.pairs(MaxEnded, "ended"); k > 0 {
					l.Ended = make([]Ended, k)
					for j := range l.Ended {
						at := r.count()
						l.Ended[j] = Ended{At: at, End: at + r.count()}
						if l.Ended[j].End < 0 { // the sum of two counts wrapped
							r.fail("ended request time")
						}
					}
				}
			}
			m.Loads = append(m.Loads, l)
		}
	case KindSpec:
		if r.err == nil && n > uint64(len(r.b))/4 { // name, ttl, count: at least 4 bytes
			r.fail("%d spec entries in %d bytes", n, len(r.b))
		}
		if r.err == nil && n > 0 {
			m.Specs = make([]Spec, 0, n)
		}
		for i := uint64(0); i < n && r.err == nil; i++ {
			s := Spec{Instance: r.name("instance")}
			ttl := r.uvarint()
			if r.err == nil && ttl > uint64(MaxTTL/time.Millisecond) {
				r.fail("ttl %dms", ttl)
			}
			s.TTL = time.Duration(ttl) * time.Millisecond
			k := r.uvarint()
			if r.err == nil && k > uint64(len(r.b))/8 {
				r.fail("%d keys in %d bytes", k, len(r.b))
			}
			if r.err == nil {
				s.Keys = make([]uint64, k)
				for j := range s.Keys {
					s.Keys[j] = binary.LittleEndian.Uint64(r.b[8*j:])
				}
				r.b = r.b[8*k:]
			}
			m.Specs = append(m.Specs, s)
		}
	case KindHello:
		if r.err == nil && n != 0 {
			r.fail("hello with %d entries", n)
		}
	case KindCommit:
		if v < 7 || r.err == nil && n != 1 {
			r.fail("commit in version %d with %d entries", v, n)
		}
		m.Committed = r.uvarint()
	case KindPlacement:
		if v < 4 {
			r.fail("placement in version %d", v)
		}
		m.Computed = r.placementValue("computed tokens")
		if r.err == nil && n > uint64(len(r.b))/10 { // name of >= 1 byte, length, 8 bytes
			r.fail("%d placement entries in %d bytes", n, len(r.b))
		}
		if r.err == nil && n > 0 {
			m.Queues = make([]Queued, 0, n)
		}
		for i := uint64(0); i < n && r.err == nil; i++ {
			q := Queued{Instance: r.name("instance")}
			q.Wait = r.placementValue("queue")
			m.Queues = append(m.Queues, q)
		}
	case KindRent:
		if v < 5 {
			r.fail("rent in version %d", v)
		}
		if r.err == nil && n > uint64(len(r.b))/17 { // key, gen, rent: at least 17 bytes
			r.fail("%d rent entries in %d bytes", n, len(r.b))
		}
		if r.err == nil && n > 0 {
			m.Rents = make([]Rent, 0, n)
		}
		for i := uint64(0); i < n && r.err == nil; i++ {
			e := Rent{Key: r.u64le()}
			e.Gen = uint64(r.count()) // <= MaxRentGen
			e.Rent = r.placementValue("rent")
			if r.err == nil && e.Rent > MaxRent {
				r.fail("rent %v", e.Rent)
			}
			m.Rents = append(m.Rents, e)
		}
	case KindIntent:
		if v < 6 {
			r.fail("intent in version %d", v)
		}
		if r.err == nil && n > uint64(len(r.b))/13 { // seq, arrival, priority, tokens, hash, count: at least 13 bytes
			r.fail("%d intents in %d bytes", n, len(r.b))
		}
		if r.err == nil && n > 0 {
			m.Intents = make([]Intent, 0, n)
		}
		for i := uint64(0); i < n && r.err == nil; i++ {
			in := Intent{Replica: m.Replica, Incarnation: m.Incarnation, Seq: r.uvarint(), Arrival: r.count(), RemotePrefill: remote}
			in.Priority = r.priority()
			in.Tokens = int(r.counter())
			in.Hash = r.u64le()
			k := r.uvarint()
			if r.err == nil && (k > MaxIntentKeys || k > uint64(len(r.b))/8) {
				r.fail("%d intent keys in %d bytes", k, len(r.b))
			}
			if r.err == nil && k > 0 {
				in.Keys = make([]uint64, k)
				for j := range in.Keys {
					in.Keys[j] = binary.LittleEndian.Uint64(r.b[8*j:])
				}
				r.b = r.b[8*k:]
			}
			m.Intents = append(m.Intents, in)
		}
	default:
		r.fail("kind %d", m.Kind)
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
	if r.err != nil {
		return Message{}, r.err
	}
	return m, nil
}

// reader consumes b; the first error sticks and later reads return zero.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
	}
}

func (r *reader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

// pairs reads the length of a list of at most limit pairs of uvarints
// (each at least 2 bytes); 0 after an error.
func (r *reader) pairs(limit int, what string) uint64 {
	k := r.uvarint()
	if r.err == nil && (k > uint64(limit) || k > uint64(len(r.b))/2) {
		r.fail("%d %s requests in %d bytes", k, what, len(r.b))
	}
	if r.err != nil {
		return 0
	}
	return k
}

// count is a non-negative int64 counter.
func (r *reader) count() int64 {
	v := r.uvarint()
	if v > 1<<62 {
		r.fail("counter %d", v)
		return 0
	}
	return int64(v)
}

// counter is a count bounded by MaxCounter (a load's counters, tokens).
func (r *reader) counter() int64 {
	v := r.uvarint()
	if v > MaxCounter {
		r.fail("counter %d above MaxCounter", v)
		return 0
	}
	return int64(v)
}

// counter reports whether v is a counter the wire carries.
func counter(v int64) bool { return v >= 0 && v <= MaxCounter }

// priority is a signed varint within an int32 (flow control's priorities).
func (r *reader) priority() int {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 || v < math.MinInt32 || v > math.MaxInt32 {
		r.fail("bad priority")
		return 0
	}
	r.b = r.b[n:]
	return int(v)
}

func (r *reader) u64be() uint64 { return binary.BigEndian.Uint64(r.take8()) }

func (r *reader) u64le() uint64 { return binary.LittleEndian.Uint64(r.take8()) }

// take8 consumes 8 bytes (zeros after an error).
func (r *reader) take8() []byte {
	if r.err == nil && len(r.b) < 8 {
		r.fail("short")
	}
	if r.err != nil {
		return make([]byte, 8)
	}
	v := r.b[:8]
	r.b = r.b[8:]
	return v
}

// placementValue is a float64 (8 bytes, big-endian) that placementValue
// accepts.
func (r *reader) placementValue(what string) float64 {
	v := math.Float64frombits(r.u64be())
	if r.err == nil && !placementValue(v) {
		r.fail("%s %v", what, v)
		return 0
	}
	return v
}

func (r *reader) name(what string) string {
	if r.err != nil {
		return ""
	}
	if len(r.b) < 1 || len(r.b) < 1+int(r.b[0]) {
		r.fail("short %s name", what)
		return ""
	}
	s := string(r.b[1 : 1+int(r.b[0])])
	r.b = r.b[1+int(r.b[0]):]
	if err := checkName(what, s); err != nil {
		r.err = err
		return ""
	}
	return s
}
