package tick

import (
	"context"
	"errors"
	"testing"
	"time"
)

// Every calls f on every tick until ctx ends, then returns its error.
func TestEvery(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	calls := 0
	err := Every(ctx, time.Millisecond, func() {
		calls++
		if calls == 3 {
			cancel()
		}
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Every returned %v, want context.Canceled", err)
	}
	if calls != 3 && calls != 4 { // a tick ready with the cancel may run f once more
		t.Fatalf("%d calls, want 3 (or 4)", calls)
	}
}

// The first call comes a period after Every is called, not at once.
func TestEveryFirstCallAfterAPeriod(t *testing.T) {
	const d = 200 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	start := time.Now()
	var first time.Duration
	_ = Every(ctx, d, func() {
		first = time.Since(start)
		cancel()
	})
	if first < d { // a loaded machine only delays it
		t.Fatalf("first call %v after Every, want at least %v", first, d)
	}
}

// A done context returns at once, without calling f.
func TestEveryDone(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Every(ctx, time.Hour, func() { t.Fatal("f ran on a done context") }); !errors.Is(err, context.Canceled) {
		t.Fatalf("Every returned %v", err)
	}
}
