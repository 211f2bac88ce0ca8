package bridge

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

func TestTableExpired(t *testing.T) {
	var now int64 = 1000
	tb := NewTable(0)
	tb.now = func() int64 { return now }
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	// LMCache-like: chunks stored on CPU, never removed.
	tb.Apply([]events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{10, 11}, TokenIDs: toks, BlockSize: 4, Medium: "cpu"}})
	now = 2000
	tb.Apply([]events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{20}, TokenIDs: toks[:4], BlockSize: 4, Medium: "GPU"}})
	now = 3000
	// Re-storing refreshes: 11 is young again.
	tb.Apply([]events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{11}, ParentHash: 10, HasParent: true, TokenIDs: toks[4:], BlockSize: 4, Medium: "CPU"}})
	if got := tb.Expired(tiers.CPU, 2500, 0); !slices.Equal(got, []uint64{10}) {
		t.Errorf("Expired(cpu, 2500) = %v, want [10]", got)
	}
	if got := tb.Expired(tiers.CPU, 5000, 1); !slices.Equal(got, []uint64{10}) {
		t.Errorf("Expired(cpu, 5000, max 1) = %v, want the oldest, [10]", got)
	}
	if got := tb.Expired(tiers.GPU, 2500, 0); !slices.Equal(got, []uint64{20}) {
		t.Errorf("Expired(gpu, 2500) = %v, want [20]", got)
	}
	// Aging removes like the engine would: 10 becomes a ghost (11 descends from it).
	res := tb.Apply([]events.Event{{Kind: events.BlockRemoved, BlockHashes: []uint64{10}, Medium: tierMedium[tiers.CPU]}})
	if len(res.Removed) != 1 || tb.Len() != 2 || tb.Ghosts() != 1 {
		t.Errorf("after aging 10: %+v, len %d, ghosts %d", res, tb.Len(), tb.Ghosts())
	}
}

func TestParseAgeOut(t *testing.T) {
	got, err := ParseAgeOut("cpu=10m, shared=1h")
	if err != nil || got[tiers.CPU] != 10*time.Minute || got[tiers.Shared] != time.Hour || len(got) != 2 {
		t.Errorf("ParseAgeOut = %v, %v", got, err)
	}
	for _, bad := range []string{"gpu=1m", "cpu", "cpu=0s", "cpu=-1m", "tape=1m", "cpu=soon"} {
		if _, err := ParseAgeOut(bad); err == nil {
			t.Errorf("ParseAgeOut(%q) accepted", bad)
		}
	}
	if got, err := ParseAgeOut(""); err != nil || len(got) != 0 {
		t.Errorf("ParseAgeOut(\"\") = %v, %v", got, err)
	}
	if d := ageInterval(map[tiers.Tier]time.Duration{tiers.CPU: 10 * time.Minute, tiers.Shared: 2 * time.Second}); d != time.Second {
		t.Errorf("ageInterval = %v, want the 1s floor", d)
	}
	if d := ageInterval(map[tiers.Tier]time.Duration{tiers.CPU: time.Hour}); d != time.Minute {
		t.Errorf("ageInterval = %v, want the 1m ceiling", d)
	}
}

// ParseAgeOut never panics; what it accepts is a positive duration per
// non-GPU tier, and writing that map out again parses to the same map.
func FuzzParseAgeOut(f *testing.F) {
	for _, s := range []string{"", "cpu=10m", "cpu=1h,disk=24h", " shared = 5s ", "gpu=1s", "cpu=0s", "cpu=-1s", "cpu", "cpu=1m,cpu=2m", "disk=1h,,", "cpu=1e3s"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseAgeOut(s)
		if err != nil {
			if m != nil {
				t.Fatalf("%q: error %v with a map %v", s, err, m)
			}
			return
		}
		var parts []string
		for tier, d := range m {
			if tier == tiers.GPU || d <= 0 {
				t.Fatalf("%q: accepted %s=%v", s, tier, d)
			}
			parts = append(parts, tier.String()+"="+d.String())
		}
		again, err := ParseAgeOut(strings.Join(parts, ","))
		if err != nil || !maps.Equal(again, m) {
			t.Fatalf("%q: %v written out as %q parses to %v, %v", s, m, parts, again, err)
		}
	})
}
