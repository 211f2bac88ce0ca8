package kvstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// EnsureAll returns configuration errors at once (they never go away) and
// makes everything when the configuration is sound.
func TestEnsureAllConfigErrors(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	nc := testenv.Connect(t, testenv.NATSURL(t))
	js, _ := jetstream.New(nc)
	name := testenv.UniqueName(t)
	log := slog.New(slog.DiscardHandler)
	// The first stream takes kv.events.>: any other stream asking for it
	// is rejected by the server (subject overlap, a 400).
	first, err := EnsureAll(ctx, js, StreamConfig{Name: "A_" + name, Memory: true}, BucketConfig{Name: "B_" + name, Memory: true}, log)
	if err != nil {
		t.Fatal(err)
	}
	if first.Stream == nil || first.Bucket == nil || first.ObjectStore == nil {
		t.Fatalf("resources %+v", first)
	}
	tests := []struct {
		name   string
		stream StreamConfig
		bucket BucketConfig
	}{
		{"subject overlap with another stream", StreamConfig{Name: "O_" + name, Memory: true}, BucketConfig{Name: "B_" + name, Memory: true}},
		{"negative stream limit", StreamConfig{Name: "N_" + name, MaxAge: -time.Second}, BucketConfig{Name: "B_" + name}},
		{"negative bucket ttl", StreamConfig{Name: "A_" + name}, BucketConfig{Name: "T_" + name, TTL: -time.Second}},
		{"invalid stream name", StreamConfig{Name: "bad.name"}, BucketConfig{Name: "B_" + name}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			_, err := EnsureAll(cctx, js, tc.stream, tc.bucket, log)
			if err == nil {
				t.Fatal("no error")
			}
			if cctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("retried until the deadline instead of returning the config error: %v", err)
			}
			if !IsConfigError(err) {
				t.Fatalf("IsConfigError(%v) = false", err)
			}
		})
	}
}

// An outage is not a configuration error: EnsureAll keeps retrying until
// the context ends, and comes up when NATS does.
func TestEnsureAllRetriesOutage(t *testing.T) {
	port := testenv.FreePort(t)
	nc, err := nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d", port), nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	name := testenv.UniqueName(t)
	cfgS, cfgB := StreamConfig{Name: "S_" + name, Memory: true}, BucketConfig{Name: "B_" + name, Memory: true}

	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	if _, err := EnsureAll(ctx, js, cfgS, cfgB, slog.New(slog.DiscardHandler)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("no server: err = %v, want the context's deadline", err)
	}
	if IsConfigError(ctx.Err()) {
		t.Fatal("a deadline counted as a config error")
	}
}

// Bridges and routers starting together race to create the same stream,
// bucket and object store; the losers find what the winner made (the
// server may tell them "subjects overlap" rather than "name in use"),
// and none fails.
func TestEnsureAllConcurrentCreators(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	ns := testenv.StartNATS(t)
	const creators = 8
	for round := 0; round < 5; round++ {
		name := testenv.UniqueName(t)
		cfgS, cfgB := StreamConfig{Name: "S_" + name, Memory: true}, BucketConfig{Name: "B_" + name, Memory: true}
		errs := make(chan error, creators)
		for i := 0; i < creators; i++ {
			go func() {
				nc, err := nats.Connect(ns.URL())
				if err != nil {
					errs <- err
					return
				}
				defer nc.Close()
				js, _ := jetstream.New(nc)
				_, err = EnsureAll(ctx, js, cfgS, cfgB, slog.New(slog.DiscardHandler))
				errs <- err
			}()
		}
		for i := 0; i < creators; i++ {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: creator failed: %v", round, err)
			}
		}
		// Delete the stream so the next round's creators race for the
		// same subjects again.
		nc, err := nats.Connect(ns.URL())
		if err != nil {
			t.Fatal(err)
		}
		js, _ := jetstream.New(nc)
		if err := js.DeleteStream(ctx, cfgS.Name); err != nil {
			t.Fatal(err)
		}
		nc.Close()
	}
}
