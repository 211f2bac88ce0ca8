// Package tick runs periodic work: the ticker loop that the router's
// background goroutines (consumer checks, fleet
// reconciliation, the bridge's age sweeps, kvctl's summaries) all ran
// written out, once.
package tick

import (
	"context"
	"time"
)

// Every calls f every d, the first time d after the call, until ctx is
// done; it then returns ctx.Err() (a tick that is ready when ctx ends may
// still run f once: select picks either). f runs on the caller's goroutine, so a
// slow f delays the next call rather than overlapping it (the ticker drops
// the ticks it missed). d must be positive, as for time.NewTicker.
func Every(ctx context.Context, d time.Duration, f func()) error {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			f()
		}
	}
}
