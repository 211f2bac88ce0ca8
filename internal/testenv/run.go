package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// Go runs run in a goroutine the test owns, on a context derived from ctx.
// stop cancels that context and waits for run to return; the test's
// cleanup calls it too, so a test that does not stop a component early
// never leaves it running into the next test. stop may be called more than
// once. run's error is dropped: the components tests run this way return
// only the context's error once stopped, and a test asserts what they did,
// not how they ended.
func Go(t testing.TB, ctx context.Context, run func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = run(ctx) }()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

// WaitFor polls cond every 10ms until it holds, and fails the test if it
// does not within d; what names the condition in the failure.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Connect connects to the NATS server at url with opts, and closes the
// connection when the test ends.
func Connect(t testing.TB, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatalf("nats connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}
