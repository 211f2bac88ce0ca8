package replicasync

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"slices"
	"testing"
	"time"
)

func sampleMessages() []Message {
	return []Message{
		{Kind: KindHello, Replica: "r-1", Incarnation: 7},
		{Kind: KindLoad, Replica: "r-1", Incarnation: 7, Seq: 3, Complete: true,
			Loads: []Load{{Instance: "vllm-0", InFlight: 4, PendingTokens: 9000, PendingRequests: 2}, {Instance: "vllm_1", InFlight: 1}}},
		{Kind: KindLoad, Replica: "r-3", Incarnation: 2, Seq: 5,
			Loads: []Load{{Instance: "a", InFlight: 2, PendingTokens: 5000, PendingRequests: 2, Rate: 21000, Started: 1_800_000_000_000_000_000,
				Pending: []Pending{{At: 1_800_000_000_100_000_000, Tokens: 3000}, {At: 1_800_000_000_200_000_000, Tokens: 2000}},
				Ended:   []Ended{{At: 1_799_999_999_000_000_000, End: 1_799_999_999_900_000_000}, {At: 5, End: 5}}},
				{Instance: "b", Ended: []Ended{{At: 1, End: 2}}}}},
		{Kind: KindLoad, Replica: "r-2", Incarnation: 1 << 63, Seq: 1 << 40},
		{Kind: KindSpec, Replica: "r-2", Incarnation: 9, Seq: 2,
			Specs: []Spec{{Instance: "a", TTL: 2 * time.Second, Keys: []uint64{1, 2, 1<<64 - 1}}, {Instance: "b", TTL: time.Millisecond, Keys: []uint64{}}}},
		{Kind: KindPlacement, Replica: "r-4", Incarnation: 3, Complete: true, Computed: 612.25,
			Queues: []Queued{{Instance: "vllm-0", Wait: 0.0125}, {Instance: "vllm-1", Wait: 0}}},
		{Kind: KindPlacement, Replica: "r-4", Incarnation: 3},
		{Kind: KindRent, Replica: "r-5", Incarnation: 4, Complete: true,
			Rents: []Rent{{Key: 1, Gen: 0, Rent: 0.375}, {Key: 1<<64 - 1, Gen: 1 << 40, Rent: 0}, {Key: 9}}},
		{Kind: KindIntent, Replica: "r-6", Incarnation: 5, Intents: []Intent{
			{Replica: "r-6", Incarnation: 5, Seq: 1, Arrival: 1_800_000_000_000_000_000, Priority: -3, Tokens: 8000, Hash: 0xfeedface, Keys: []uint64{1, 2, 3}},
			{Replica: "r-6", Incarnation: 5, Seq: 2, Arrival: 1_800_000_000_000_000_001, Tokens: 10}}},
		{Kind: KindRent, Replica: "r-5", Incarnation: 4},
		{Kind: KindCommit, Replica: "r-6", Incarnation: 5, Committed: 1<<64 - 1},
		{Kind: KindCommit, Replica: "r-6", Incarnation: 5},
		{Kind: KindIntent, Replica: "r-7", Incarnation: 6, Intents: []Intent{
			{Replica: "r-7", Incarnation: 6, Seq: 3, Arrival: 5, Tokens: 4096, Keys: []uint64{7}, RemotePrefill: true}}},
	}
}

func TestRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		b, err := m.AppendBinary(nil)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("%+v: %v", m, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, m)
		}
	}
}

func TestDecodeRefuses(t *testing.T) {
	good, _ := sampleMessages()[1].AppendBinary(nil)
	newer := bytes.Clone(good)
	newer[3] = Version + 1
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, ErrMagic},
		{"other traffic", []byte(`{"json":1}`), ErrMagic},
		{"newer version", newer, ErrVersion},
		{"truncated", good[:len(good)-1], ErrMalformed},
		{"trailing", append(bytes.Clone(good), 0), ErrMalformed},
		{"unknown kind", []byte{'K', 'R', 'S', Version, 9, 0, 1, 'a', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, ErrMalformed},
		{"bad replica name", []byte{'K', 'R', 'S', Version, 3, 0, 1, '.', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, ErrMalformed},
		{"huge count", []byte{'K', 'R', 'S', Version, 1, 0, 1, 'a', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0x03}, ErrMalformed},
		{"keys beyond the end", []byte{'K', 'R', 'S', Version, 2, 0, 1, 'a', 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 'b', 0, 5, 1, 2, 3}, ErrMalformed},
	}
	for _, tc := range tests {
		if _, err := Decode(tc.in); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	for _, m := range []Message{
		{Kind: KindLoad, Replica: "", Incarnation: 1},
		{Kind: KindLoad, Replica: "r", Loads: []Load{{Instance: "a.b"}}},
		{Kind: KindLoad, Replica: "r", Loads: []Load{{Instance: "a", InFlight: -1}}},
		{Kind: KindLoad, Replica: "r", Loads: []Load{{Instance: "a", Ended: []Ended{{At: 2, End: 1}}}}},
		{Kind: KindLoad, Replica: "r", Loads: []Load{{Instance: "a", Ended: make([]Ended, MaxEnded+1)}}},
		{Kind: 0, Replica: "r"},
		{Kind: KindPlacement, Replica: "r", Computed: math.NaN()},
		{Kind: KindPlacement, Replica: "r", Computed: -1},
		{Kind: KindPlacement, Replica: "r", Queues: []Queued{{Instance: "a", Wait: math.Inf(1)}}},
		{Kind: KindPlacement, Replica: "r", Queues: []Queued{{Instance: "a.b"}}},
	} {
		if _, err := m.AppendBinary(nil); err == nil {
			t.Errorf("encoded %+v", m)
		}
	}
}

// Only the placement message needs version 4: load, spec and hello
// messages go out as version 3, which a version 3 peer reads; a placement
// message claiming an older version, or carrying a value a sender may
// not send, is refused.
func TestPlacementVersion(t *testing.T) {
	for _, m := range sampleMessages() {
		b, err := m.AppendBinary(nil)
		if err != nil {
			t.Fatal(err)
		}
		want := byte(3)
		switch m.Kind {
		case KindPlacement:
			want = 4
		case KindRent:
			want = 5
		case KindIntent:
			want = 6
		case KindCommit:
			want = 7
		}
		if b[3] != want {
			t.Errorf("%s message goes out as version %d, want %d", m.Kind, b[3], want)
		}
	}
	m := Message{Kind: KindPlacement, Replica: "r", Computed: 100, Queues: []Queued{{Instance: "a", Wait: 0.5}}}
	good, _ := m.AppendBinary(nil)
	older := bytes.Clone(good)
	older[3] = 3
	if _, err := Decode(older); !errors.Is(err, ErrMalformed) {
		t.Errorf("placement as version 3: %v, want malformed", err)
	}
	refusesBadTail(t, good, len(good)-8-2-8-1, nil)
}

// refusesBadTail checks that Decode refuses good (one entry ending in a
// float64) with a value a sender may not send in its last 8 bytes
// (rejected by encode too, if given), or with the entry count at
// countAt beyond the bytes.
func refusesBadTail(t *testing.T, good []byte, countAt int, encode func(float64) error) {
	t.Helper()
	for name, v := range map[string]float64{"NaN": math.NaN(), "negative": -2, "infinite": math.Inf(1)} {
		bad := bytes.Clone(good)
		binary.BigEndian.PutUint64(bad[len(bad)-8:], math.Float64bits(v))
		if _, err := Decode(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s value: %v, want malformed", name, err)
		}
		if encode != nil {
			if err := encode(v); !errors.Is(err, ErrMalformed) {
				t.Errorf("%s value encoded: %v, want malformed", name, err)
			}
		}
	}
	huge := bytes.Clone(good)
	huge[countAt] = 0x7f // the entry count
	if _, err := Decode(huge); !errors.Is(err, ErrMalformed) {
		t.Errorf("entry count beyond the bytes: %v, want malformed", err)
	}
}

// Only the rent message needs version 5 (a version 4 peer drops it as of
// a newer version and reads the rest); one claiming an older version, or
// carrying a rent a sender may not send, is refused.
func TestRentVersion(t *testing.T) {
	m := Message{Kind: KindRent, Replica: "r", Rents: []Rent{{Key: 5, Gen: 2, Rent: 0.5}}}
	good, err := m.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	if good[3] != 5 {
		t.Fatalf("rent goes out as version %d", good[3])
	}
	older := bytes.Clone(good)
	older[3] = 4
	if _, err := Decode(older); !errors.Is(err, ErrMalformed) {
		t.Errorf("rent as version 4: %v, want malformed", err)
	}
	refusesBadTail(t, good, len(good)-8-1-8-1, func(v float64) error {
		_, err := (&Message{Kind: KindRent, Replica: "r", Rents: []Rent{{Key: 5, Rent: v}}}).AppendBinary(nil)
		return err
	})
}

// The intent message goes out as version 6, is refused in an older
// version's clothing, and Decode refuses keys beyond MaxIntentKeys and a
// priority outside int32.
func TestIntentVersion(t *testing.T) {
	m := Message{Kind: KindIntent, Replica: "r", Intents: []Intent{{Replica: "r", Seq: 7, Arrival: 5, Priority: 2, Tokens: 32, Hash: 9, Keys: []uint64{4, 5}}}}
	good, err := m.AppendBinary(nil)
	if err != nil || good[3] != 6 {
		t.Fatalf("intent goes out as version %d (%v)", good[3], err)
	}
	back, err := Decode(good)
	if err != nil || !reflect.DeepEqual(back, m) {
		t.Fatalf("round trip %+v %v, want %+v", back, err, m)
	}
	older := bytes.Clone(good)
	older[3] = 5
	if _, err := Decode(older); !errors.Is(err, ErrMalformed) {
		t.Errorf("intent as version 5: %v, want malformed", err)
	}
	big := Message{Kind: KindIntent, Replica: "r", Intents: []Intent{{Keys: make([]uint64, MaxIntentKeys+1)}}}
	if _, err := big.AppendBinary(nil); !errors.Is(err, ErrMalformed) {
		t.Errorf("encoding %d keys: %v, want malformed", MaxIntentKeys+1, err)
	}
	// The same bytes with the key count raised past the bound.
	head, _ := (&Message{Kind: KindIntent, Replica: "r", Intents: []Intent{{}}}).AppendBinary(nil)
	b := binary.AppendUvarint(head[:len(head)-1], MaxIntentKeys+1)
	b = append(b, make([]byte, 8*(MaxIntentKeys+1))...)
	if _, err := Decode(b); !errors.Is(err, ErrMalformed) {
		t.Errorf("decoding %d keys: %v, want malformed", MaxIntentKeys+1, err)
	}
	// Priority 2^31: seq 0, arrival 0, then the priority's varint.
	p := append(bytes.Clone(head[:len(head)-1-8-1-1]), binary.AppendVarint(nil, 1<<31)...)
	p = append(p, 0)
	p = binary.LittleEndian.AppendUint64(p, 0)
	p = append(p, 0)
	if _, err := Decode(p); !errors.Is(err, ErrMalformed) {
		t.Errorf("priority 2^31: %v, want malformed", err)
	}
}

// A peer's rent accounts: a complete message replaces the previous ones,
// a partial one replaces the listed accounts and drops the removed; the
// account of a key is the sum of the rents of the latest generation any
// live replica knows, own included; a silent peer's rent stops counting
// and a restarted peer's old accounts are gone.
func TestTableRent(t *testing.T) {
	now := time.Unix(100, 0)
	tb := NewTable(time.Second, 16, func() time.Time { return now })
	if g, acc := tb.RentAccount(7, 2, 0.5); g != 2 || acc != 0.5 {
		t.Fatalf("no peers: gen %d account %v, want own (2, 0.5)", g, acc)
	}
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "a", Incarnation: 1, Complete: true, Rents: []Rent{{Key: 7, Gen: 2, Rent: 0.25}, {Key: 8, Gen: 0, Rent: 1}}})
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "b", Incarnation: 1, Complete: true, Rents: []Rent{{Key: 7, Gen: 2, Rent: 0.125}}})
	if g, acc := tb.RentAccount(7, 2, 0.5); g != 2 || acc != 0.875 {
		t.Fatalf("same gen: (%d, %v), want (2, 0.875)", g, acc)
	}
	if g, acc := tb.RentAccount(7, 1, 0.5); g != 2 || acc != 0.375 {
		t.Fatalf("own gen behind: (%d, %v), want the peers' (2, 0.375)", g, acc)
	}
	if g, acc := tb.RentAccount(7, 3, 0); g != 3 || acc != 0 {
		t.Fatalf("own purchase ahead: (%d, %v), want (3, 0)", g, acc)
	}
	// b bought a copy: generation 3 with nothing paid; a's rent is of 2.
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "b", Incarnation: 1, Rents: []Rent{{Key: 7, Gen: 3}}})
	if g, acc := tb.RentAccount(7, 2, 0.5); g != 3 || acc != 0 {
		t.Fatalf("after b's purchase: (%d, %v), want (3, 0)", g, acc)
	}
	// a drops 8, a partial message keeps a's 7.
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "a", Incarnation: 1, Rents: []Rent{{Key: 8}}})
	if _, acc := tb.RentAccount(8, 0, 0); acc != 0 {
		t.Fatalf("removed account counts %v", acc)
	}
	if _, acc := tb.RentAccount(7, 0, 0); acc != 0 {
		t.Fatalf("7: %v", acc)
	}
	// b goes silent: its generation stops counting, a's rent is back.
	now = now.Add(800 * time.Millisecond)
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "a", Incarnation: 1, Rents: []Rent{{Key: 7, Gen: 2, Rent: 0.75}}})
	now = now.Add(400 * time.Millisecond)
	if g, acc := tb.RentAccount(7, 2, 0.5); g != 2 || acc != 1.25 {
		t.Fatalf("after b's timeout: (%d, %v), want (2, 1.25)", g, acc)
	}
	// A new incarnation of a: its old accounts are gone.
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "a", Incarnation: 2, Rents: []Rent{{Key: 9, Gen: 1, Rent: 1}}})
	if g, acc := tb.RentAccount(7, 2, 0.5); g != 2 || acc != 0.5 {
		t.Fatalf("after a's restart: (%d, %v), want own (2, 0.5)", g, acc)
	}
	// A peer's accounts are bounded: new keys beyond MaxPeerRents wait
	// for its next whole table; known ones still update.
	big := make([]Rent, MaxPeerRents+10)
	for i := range big {
		big[i] = Rent{Key: uint64(1000 + i), Rent: 1}
	}
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "c", Incarnation: 1, Complete: true, Rents: big})
	if _, acc := tb.RentAccount(uint64(1000+MaxPeerRents), 0, 0); acc != 0 {
		t.Fatalf("account beyond the bound held: %v", acc)
	}
	tb.ApplyRent(&Message{Kind: KindRent, Replica: "c", Incarnation: 1, Rents: []Rent{{Key: 1000, Rent: 2}}})
	if _, acc := tb.RentAccount(1000, 0, 0); acc != 2 {
		t.Fatalf("held account not updated: %v", acc)
	}
}

// A placement message replaces what the peer said before when complete
// and adds to it otherwise; a peer silent for the timeout counts nothing;
// a new incarnation's replaces the old one's.
func TestTablePlacement(t *testing.T) {
	now := time.Unix(100, 0)
	tb := NewTable(time.Second, 16, func() time.Time { return now })
	if vals, n := tb.PeerComputed(nil); n != 0 || len(vals) != 0 {
		t.Fatalf("empty table: %v from %d peers", vals, n)
	}
	tb.ApplyPlacement(&Message{Kind: KindPlacement, Replica: "a", Incarnation: 1, Complete: true, Computed: 500, Queues: []Queued{{"i0", 0.5}, {"i1", 0.25}}})
	tb.ApplyPlacement(&Message{Kind: KindPlacement, Replica: "b", Incarnation: 1, Complete: true, Queues: []Queued{{"i0", 0.125}}})
	vals, n := tb.PeerComputed(nil)
	if n != 2 || !slices.Equal(vals, []float64{500}) {
		t.Fatalf("computed %v from %d peers, want [500] (b has measured none) from 2", vals, n)
	}
	got := tb.PeerQueued("i0", nil)
	slices.Sort(got)
	if !slices.Equal(got, []float64{0.125, 0.5}) {
		t.Fatalf("i0 queues %v", got)
	}
	// Partial adds, complete replaces.
	tb.ApplyPlacement(&Message{Kind: KindPlacement, Replica: "b", Incarnation: 1, Queues: []Queued{{"i1", 1}}})
	if got := tb.PeerQueued("i0", nil); len(got) != 2 {
		t.Fatalf("a partial message dropped b's i0: %v", got)
	}
	tb.ApplyPlacement(&Message{Kind: KindPlacement, Replica: "a", Incarnation: 1, Complete: true, Computed: 400, Queues: []Queued{{"i1", 2}}})
	if got := tb.PeerQueued("i0", nil); !slices.Equal(got, []float64{0.125}) {
		t.Fatalf("a complete message kept a's old i0: %v", got)
	}
	// A new incarnation of b: its old averages are gone.
	tb.ApplyPlacement(&Message{Kind: KindPlacement, Replica: "b", Incarnation: 2, Complete: true, Computed: 300})
	if got := tb.PeerQueued("i0", nil); len(got) != 0 {
		t.Fatalf("restarted b's old i0 still counts: %v", got)
	}
	// b goes silent; a speaks on.
	now = now.Add(800 * time.Millisecond)
	tb.Touch("a", 1)
	now = now.Add(400 * time.Millisecond)
	vals, n = tb.PeerComputed(nil)
	if n != 1 || !slices.Equal(vals, []float64{400}) {
		t.Fatalf("after b's timeout: %v from %d peers, want [400] from 1", vals, n)
	}
}

// TestDecodeVersion1 reads a version 1 load message (no rate, no pending
// list): a replica of the previous version is still counted, its pending
// prefill in full.
func TestDecodeVersion1(t *testing.T) {
	v1 := []byte{'K', 'R', 'S', 1, byte(KindLoad), flagComplete, 2, 'r', '1', 0, 0, 0, 0, 0, 0, 0, 7, 3, 1,
		1, 'a', 4, 0xa8, 0x46, 2} // instance a: 4 in flight, 9000 pending tokens in 2 requests
	m, err := Decode(v1)
	if err != nil {
		t.Fatal(err)
	}
	want := Message{Kind: KindLoad, Replica: "r1", Incarnation: 7, Seq: 3, Complete: true,
		Loads: []Load{{Instance: "a", InFlight: 4, PendingTokens: 9000, PendingRequests: 2}}}
	if !reflect.DeepEqual(m, want) {
		t.Fatalf("got %+v\nwant %+v", m, want)
	}
	tb := NewTable(time.Second, 16, nil)
	tb.ApplyLoad(&m)
	var q PeerQueue
	tb.PeerQueue("a", &q)
	if q.Unlisted != 9000 || len(q.Pending) != 0 || len(q.Rates) != 0 {
		t.Fatalf("version 1 peer's queue %+v, want 9000 unlisted", q)
	}
}

// TestDecodeVersion2 reads a version 2 load message (no ended requests):
// its entries list none. The same bytes marked version 3 are short.
func TestDecodeVersion2(t *testing.T) {
	v2 := []byte{'K', 'R', 'S', 2, byte(KindLoad), flagComplete, 2, 'r', '2', 0, 0, 0, 0, 0, 0, 0, 7, 3, 1,
		1, 'a', 1, 0xe8, 0x07, 1, 0x90, 0x4e, 0, 1, 5, 0xe8, 0x07} // a: 1 in flight, 1000 pending tokens in 1 request at 5, rate 10000
	m, err := Decode(v2)
	if err != nil {
		t.Fatal(err)
	}
	want := Message{Kind: KindLoad, Replica: "r2", Incarnation: 7, Seq: 3, Complete: true,
		Loads: []Load{{Instance: "a", InFlight: 1, PendingTokens: 1000, PendingRequests: 1, Rate: 10000, Pending: []Pending{{At: 5, Tokens: 1000}}}}}
	if !reflect.DeepEqual(m, want) {
		t.Fatalf("got %+v\nwant %+v", m, want)
	}
	v3 := bytes.Clone(v2)
	v3[3] = 3
	if _, err := Decode(v3); !errors.Is(err, ErrMalformed) {
		t.Fatalf("version 3 without the ended list: %v", err)
	}
}

// A peer's entry that holds only recent ends (nothing in flight) is kept
// and listed; an empty one is forgotten.
func TestTableEnded(t *testing.T) {
	tb := NewTable(time.Second, 16, nil)
	e := []Ended{{At: 1, End: 3}}
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 1, Complete: true, Loads: []Load{{Instance: "x", Ended: e}}})
	for _, c := range []struct {
		asked, got int64
		want       int
	}{{2, 2, 1}, {0, 1, 0}, {3, 4, 0}, {0, 2, 1}, {2, 5, 1}} {
		if n := tb.PeerEnded("x", c.asked, c.got); n != c.want {
			t.Errorf("a sample asked at %d, answered at %d: %d ended, want %d", c.asked, c.got, n, c.want)
		}
	}
	// A delta's ends add to those held; a complete table replaces them.
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 2, Loads: []Load{{Instance: "x", InFlight: 1, Ended: []Ended{{At: 4, End: 6}, {At: 1, End: 3}}}}})
	if n := tb.PeerEnded("x", 2, 5); n != 2 {
		t.Fatalf("after a delta: %d ended, want 2 (held and added, once each)", n)
	}
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 3, Complete: true, Loads: []Load{{Instance: "x", Ended: []Ended{{At: 4, End: 6}}}}})
	if n := tb.PeerEnded("x", 2, 5); n != 1 {
		t.Fatalf("after a complete table: %d ended, want 1", n)
	}
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 4, Loads: []Load{{Instance: "x"}}})
	if n := tb.PeerEnded("x", 2, 5); n != 0 {
		t.Fatalf("an emptied entry still counts %d", n)
	}
}

// A delta carries only the ends added since the last message, unless that
// would say the instance holds nothing; merged, at most MaxEnded are held.
func TestEndedDelta(t *testing.T) {
	a, b, c := Ended{At: 1, End: 2}, Ended{At: 2, End: 3}, Ended{At: 3, End: 4}
	l := Load{Instance: "x", InFlight: 1, Ended: []Ended{b, c}}
	if d := l.sinceSent([]Ended{a, b}); !reflect.DeepEqual(d.Ended, []Ended{c}) {
		t.Fatalf("delta ends %v, want [c]", d.Ended)
	}
	if d := l.sinceSent([]Ended{c}); len(d.Ended) != 0 || d.InFlight != 1 {
		t.Fatalf("nothing new: %+v", d)
	}
	if d := l.sinceSent([]Ended{{At: 9, End: 9}}); len(d.Ended) != 2 {
		t.Fatalf("the last one sent is gone: %v, want the whole list", d.Ended)
	}
	idle := Load{Instance: "x", Ended: []Ended{b, c}}
	if d := idle.sinceSent([]Ended{b, c}); len(d.Ended) != 2 {
		t.Fatalf("an idle instance with ends sent as %+v (would read as nothing)", d)
	}
	var held []Ended
	for i := range MaxEnded + 5 {
		e := Ended{At: int64(i), End: int64(i)}
		held = mergeEnded(held, []Ended{e})
		held = mergeEnded(held, []Ended{e}) // sent again: held once
	}
	if len(held) != MaxEnded || held[0].At != 5 {
		t.Fatalf("merged %d, oldest %v", len(held), held[0])
	}
	// Two requests routed and ended at the same instant both count.
	if got := mergeEnded(nil, []Ended{a, a}); len(got) != 2 {
		t.Fatalf("two equal ends merged into %v", got)
	}
}

// The remote-prefill bit of an intent (version 8) rides on the intent
// message's flags, which older decoders read bit 0 of only: the message
// still goes out as version 6, a version 6 or 7 decoder (the same bytes,
// the bit masked as theirs mask it) reads the intent as before, and this
// one reads an older peer's intent (no bit) as a prefill pick. Intents of
// one message differing in the bit are not encoded (one flag carries it).
func TestIntentRemotePrefillBit(t *testing.T) {
	in := Intent{Replica: "r", Incarnation: 2, Seq: 7, Arrival: 5, Tokens: 32, Hash: 9, Keys: []uint64{4, 5}, RemotePrefill: true}
	m := Message{Kind: KindIntent, Replica: "r", Incarnation: 2, Intents: []Intent{in}}
	good, err := m.AppendBinary(nil)
	if err != nil || good[3] != 6 || good[5] != flagRemotePrefill {
		t.Fatalf("a remote-prefill intent goes out as version %d, flags %#x (%v); want 6, %#x", good[3], good[5], err, flagRemotePrefill)
	}
	back, err := Decode(good)
	if err != nil || !reflect.DeepEqual(back, m) {
		t.Fatalf("round trip %+v %v, want %+v", back, err, m)
	}
	// What an older peer sends (no bit): a prefill pick, as before.
	old := bytes.Clone(good)
	old[5] = 0
	if back, err := Decode(old); err != nil || back.Intents[0].RemotePrefill {
		t.Fatalf("an older peer's intent read as %+v (%v), want no remote prefill", back.Intents, err)
	}
	// Unknown flag bits are ignored, as older decoders ignore this one.
	unknown := bytes.Clone(good)
	unknown[5] |= 0x80
	if back, err := Decode(unknown); err != nil || !back.Intents[0].RemotePrefill {
		t.Fatalf("an intent with an unknown flag bit read as %+v (%v)", back.Intents, err)
	}
	// The bit means nothing on other kinds.
	load, _ := (&Message{Kind: KindLoad, Replica: "r", Loads: []Load{{Instance: "i", InFlight: 1}}}).AppendBinary(nil)
	load[5] |= flagRemotePrefill
	if back, err := Decode(load); err != nil || back.Complete || len(back.Loads) != 1 {
		t.Fatalf("a load message with bit 1 read as %+v (%v)", back, err)
	}
	mixed := Message{Kind: KindIntent, Replica: "r", Intents: []Intent{in, {Seq: 8, Tokens: 1}}}
	if _, err := mixed.AppendBinary(nil); !errors.Is(err, ErrMalformed) {
		t.Fatalf("intents differing in remote prefill in one message: %v, want malformed", err)
	}
}

// FuzzDecode: Decode never panics, and what it accepts encodes back to
// the same bytes.
func FuzzDecode(f *testing.F) {
	for _, m := range sampleMessages() {
		b, _ := m.AppendBinary(nil)
		f.Add(b)
	}
	f.Add([]byte("KRS"))
	// Rent entries at and beyond the bounds (MaxRentGen, MaxRent).
	bound, _ := (&Message{Kind: KindRent, Replica: "r", Rents: []Rent{{Key: 1, Gen: MaxRentGen, Rent: MaxRent}}}).AppendBinary(nil)
	f.Add(bound)
	head := bound[:len(bound)-8-binary.PutUvarint(make([]byte, binary.MaxVarintLen64), MaxRentGen)-8]
	for _, r := range []Rent{{Key: 1, Gen: MaxRentGen + 1}, {Key: 1, Gen: math.MaxUint64}, {Key: 1, Rent: 1e308}} {
		b := binary.LittleEndian.AppendUint64(bytes.Clone(head), r.Key)
		b = binary.AppendUvarint(b, r.Gen)
		f.Add(binary.BigEndian.AppendUint64(b, math.Float64bits(r.Rent)))
	}
	// A load counter at the bound and beyond it (MaxCounter).
	load, _ := (&Message{Kind: KindLoad, Replica: "r", Loads: []Load{{Instance: "i", InFlight: MaxCounter}}}).AppendBinary(nil)
	f.Add(load)
	f.Add(bytes.Replace(load, binary.AppendUvarint(nil, MaxCounter), binary.AppendUvarint(nil, MaxCounter+1), 1))
	// Flag bits: the remote-prefill bit on an intent message without
	// intents, on a load message, and every bit set on an intent message.
	for _, m := range []Message{{Kind: KindIntent, Replica: "r"}, {Kind: KindLoad, Replica: "r"},
		{Kind: KindIntent, Replica: "r", Intents: []Intent{{Seq: 1, Tokens: 2, RemotePrefill: true}}}} {
		b, _ := m.AppendBinary(nil)
		b[5] |= flagRemotePrefill
		f.Add(b)
		b = bytes.Clone(b)
		b[5] = 0xff
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		out, err := m.AppendBinary(nil)
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", m, err)
		}
		again, err := Decode(out)
		if err != nil || !reflect.DeepEqual(again, m) {
			t.Fatalf("re-decode: %+v %v, want %+v", again, err, m)
		}
	})
}

// A rent message's values are bounded on the wire: a generation beyond
// 2^62 (max(gen)+1 would wrap to 0, un-buying every copy) and a rent
// above MaxRent (two of 1e308 sum to +Inf and force a purchase) are
// refused, by the decoder and the encoder; the bounds themselves pass.
func TestRentBounds(t *testing.T) {
	enc := func(r Rent) ([]byte, error) {
		return (&Message{Kind: KindRent, Replica: "r", Rents: []Rent{r}}).AppendBinary(nil)
	}
	for _, r := range []Rent{{Key: 1, Gen: 1 << 62, Rent: MaxRent}, {Key: 2, Gen: 3, Rent: 1e9 - 1}} {
		b, err := enc(r)
		if err != nil {
			t.Fatalf("%+v: %v", r, err)
		}
		if m, err := Decode(b); err != nil || m.Rents[0] != r {
			t.Fatalf("%+v decodes as %+v, %v", r, m.Rents, err)
		}
	}
	good, err := enc(Rent{Key: 1, Gen: 1, Rent: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []Rent{{Key: 1, Gen: 1<<62 + 1}, {Key: 1, Gen: math.MaxUint64, Rent: 1}, {Key: 1, Gen: 1, Rent: math.Nextafter(MaxRent, math.Inf(1))}, {Key: 1, Gen: 1, Rent: 1e308}} {
		if _, err := enc(r); !errors.Is(err, ErrMalformed) {
			t.Errorf("%+v encoded: %v, want malformed", r, err)
		}
		// The same entry by hand, as a peer that does not check would.
		bad := binary.LittleEndian.AppendUint64(bytes.Clone(good[:len(good)-8-1-8]), r.Key)
		bad = binary.AppendUvarint(bad, r.Gen)
		bad = binary.BigEndian.AppendUint64(bad, math.Float64bits(r.Rent))
		if _, err := Decode(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("%+v decoded: %v, want malformed", r, err)
		}
	}
	// The sum of accounts at the bound stays finite.
	tb := NewTable(time.Hour, 16, nil)
	for _, p := range []string{"a", "b", "c"} {
		tb.ApplyRent(&Message{Kind: KindRent, Replica: p, Incarnation: 1, Complete: true, Rents: []Rent{{Key: 7, Gen: 1, Rent: MaxRent}}})
	}
	if _, acc := tb.RentAccount(7, 1, MaxRent); acc != MaxRent {
		t.Fatalf("account of four replicas at MaxRent: %v, want %v (saturated)", acc, MaxRent)
	}
}

// A counter a peer sends is bounded on the wire (MaxCounter), by the
// decoder and the encoder: the bound itself passes, one above it is
// refused. 2^62 was accepted, and two such summed negative.
func TestDecodeBoundsCounters(t *testing.T) {
	enc := func(l Load) ([]byte, error) {
		return (&Message{Kind: KindLoad, Replica: "r", Incarnation: 1, Seq: 1, Complete: true, Loads: []Load{l}}).AppendBinary(nil)
	}
	bound, err := enc(Load{Instance: "i0", InFlight: MaxCounter})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Decode(bound); err != nil {
		t.Fatalf("a counter at MaxCounter refused: %v", err)
	}
	// The same message with MaxCounter+1 in its place (the same uvarint length).
	at := binary.AppendUvarint(nil, MaxCounter)
	over := binary.AppendUvarint(nil, MaxCounter+1)
	if len(at) != len(over) || bytes.Count(bound, at) != 1 {
		t.Fatal("test cannot patch the counter")
	}
	if _, err := Decode(bytes.Replace(bound, at, over, 1)); err == nil {
		t.Error("a counter above MaxCounter decoded")
	}
	now := time.Now().UnixNano()
	for _, l := range []Load{{Instance: "i0", InFlight: 1 << 62}, {Instance: "i0", PendingTokens: MaxCounter + 1},
		{Instance: "i0", PendingRequests: MaxCounter + 1}, {Instance: "i0", Rate: MaxCounter + 1},
		{Instance: "i0", Pending: []Pending{{At: now, Tokens: MaxCounter + 1}}}} {
		if _, err := enc(l); err == nil {
			t.Errorf("encoded %+v", l)
		}
	}
	if _, err := (&Message{Kind: KindIntent, Replica: "r", Intents: []Intent{{Seq: 1, Arrival: now, Tokens: MaxCounter + 1}}}).AppendBinary(nil); err == nil {
		t.Error("encoded an intent of MaxCounter+1 tokens")
	}
}

// The sums over peers saturate: many peers (names cost a hostile sender
// nothing) claiming the most a counter may be never sum negative.
func TestPeerSumsSaturate(t *testing.T) {
	tb := NewTable(time.Minute, 16, nil)
	for _, name := range []string{"x", "y"} {
		tb.ApplyLoad(&Message{Kind: KindLoad, Replica: name, Incarnation: 1, Seq: 1, Complete: true,
			Loads: []Load{{Instance: "i0", InFlight: 1 << 62, PendingTokens: 1 << 62, PendingRequests: 1 << 62}}})
	}
	if f, tok, reqs := tb.PeerLoad("i0"); f < 0 || tok < 0 || reqs < 0 {
		t.Errorf("two peers' counters sum to %d in flight, %d tokens, %d requests", f, tok, reqs)
	}
	var q PeerQueue
	tb.PeerQueue("i0", &q)
	if q.InFlight < 0 || q.Tokens < 0 || q.Requests < 0 || q.Unlisted < 0 {
		t.Errorf("PeerQueue sums %+v", q)
	}
}

// The commit message (version 7) goes out as version 7 alone, round trips,
// and is refused in an older version or with other than one entry; the
// other kinds go out as before.
func TestCommitVersion(t *testing.T) {
	m := Message{Kind: KindCommit, Replica: "r", Incarnation: 3, Committed: 42}
	good, err := m.AppendBinary(nil)
	if err != nil || good[3] != 7 {
		t.Fatalf("commit goes out as version %d (%v)", good[3], err)
	}
	back, err := Decode(good)
	if err != nil || !reflect.DeepEqual(back, m) {
		t.Fatalf("round trip %+v %v, want %+v", back, err, m)
	}
	older := bytes.Clone(good)
	older[3] = 6
	if _, err := Decode(older); !errors.Is(err, ErrMalformed) {
		t.Errorf("commit as version 6: %v, want malformed", err)
	}
	two := append(bytes.Clone(good[:len(good)-2]), 2, 42, 43)
	if _, err := Decode(two); !errors.Is(err, ErrMalformed) {
		t.Errorf("commit of two entries: %v, want malformed", err)
	}
	for _, k := range []Kind{KindLoad, KindSpec, KindHello} {
		b, _ := (&Message{Kind: k, Replica: "r"}).AppendBinary(nil)
		if b[3] != 3 {
			t.Errorf("%v goes out as version %d, want 3", k, b[3])
		}
	}
}
