package consumer

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// The ordered consumer stops delivering without a word (as when its
// re-create request after a reconnect goes unanswered for nats.go's fixed
// 10s): the watchdog notices the stored messages left undelivered and a
// new consumer delivers them from right after
// the last one delivered: nothing skipped, nothing twice, nothing from
// before a DeliverNew start.
func TestWatchdogReplacesStalledConsumer(t *testing.T) {
	for _, shared := range []bool{false, true} {
		name := "deliver_all"
		if shared {
			name = "deliver_new"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			a := newRecorder()
			cfg := e.cfg
			cfg.Applier, cfg.SharedIndex = a, shared
			e.store("i0", 1, 1) // before the start: replayed unless DeliverNew
			c := e.start(cfg)
			e.store("i0", 2, 2)
			want := []uint64{1, 2}
			if shared {
				want = []uint64{2}
			}
			testenv.WaitFor(t, 10*time.Second, "first events applied", func() bool { s, _ := a.get("i0"); return len(s) == len(want) })

			// Stall: the consumer in use stops, silently.
			c.sc.mu.Lock()
			c.sc.cc.Stop()
			c.sc.mu.Unlock()
			stalled := time.Now()
			for i := uint64(3); i <= 6; i++ {
				e.store("i0", i, i)
				want = append(want, i)
			}
			testenv.WaitFor(t, 20*time.Second, "events after the stall applied", func() bool {
				s, _ := a.get("i0")
				return len(s) >= len(want)
			})
			took := time.Since(stalled)
			time.Sleep(200 * time.Millisecond) // a duplicate would show by now
			if got, _ := a.get("i0"); !slices.Equal(got, want) {
				t.Fatalf("applied %v, want %v", got, want)
			}
			if n := counterValue(c.m.stalls); n < 1 {
				t.Fatalf("stalls counted %v, want ≥ 1", n)
			}
			// Expected 5–6s: a heartbeat of silence, the look that first
			// sees the message waiting, then stallHeartbeats more. Twice
			// that for a loaded machine; without the watchdog it never
			// recovers at all.
			if took > 12*time.Second {
				t.Fatalf("recovered %v after the stall", took)
			}
			t.Logf("recovered %.2fs after the stall", took.Seconds())
		})
	}
}
