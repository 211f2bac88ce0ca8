package consumer

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A consumer that has replayed the whole stream is caught up even when the
// stream's newest message is older than MaxLag (an idle pool): it must
// report healthy without waiting for a new event.
func TestHealthyAfterReplayOfOldMessages(t *testing.T) {
	tests := []struct {
		name     string
		messages int
	}{
		{"one old message", 1},
		{"several old messages", 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			a := newRecorder()
			cfg := e.cfg
			cfg.Applier, cfg.MaxLag = a, 100*time.Millisecond
			for i := range tt.messages {
				e.store("vllm-0", uint64(i+1), uint64(i+1))
			}
			time.Sleep(3 * cfg.MaxLag) // every message is now older than MaxLag
			c, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			testenv.Go(t, e.ctx, c.Run)
			testenv.WaitFor(t, 10*time.Second, "replay applied", func() bool {
				s, _ := a.get("vllm-0")
				return len(s) == tt.messages
			})
			testenv.WaitFor(t, 5*time.Second, "caught-up consumer healthy", c.Healthy)
		})
	}
}
