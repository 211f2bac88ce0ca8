package kvstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// On a 3-node JetStream cluster the stream, the snapshot bucket and its
// object store are made with 3 replicas; asking for more replicas than the
// cluster has servers, or for more than one of a single server, is a
// configuration error returned at once, with the reason spelled out.
func TestEnsureAllReplicas(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	log := slog.New(slog.DiscardHandler)
	connect := func(url string) jetstream.JetStream {
		nc := testenv.Connect(t, url)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	name := testenv.UniqueName(t)
	refused := func(t *testing.T, js jetstream.JetStream, s StreamConfig, b BucketConfig, hint string) {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		_, err := EnsureAll(cctx, js, s, b, log)
		if err == nil || !IsConfigError(err) || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("EnsureAll(%+v, %+v) = %v, want a configuration error at once", s, b, err)
		}
		if !strings.Contains(err.Error(), hint) {
			t.Fatalf("error %q does not say %q", err, hint)
		}
	}

	t.Run("cluster", func(t *testing.T) {
		c := testenv.StartNATSCluster(t, 3)
		js := connect(c.URLs())
		// (before any stream holds kv.events.>: the server checks subjects first)
		refused(t, js, StreamConfig{Name: "F_" + name, Replicas: 5}, BucketConfig{Name: "G_" + name}, "at least 5 servers")
		r, err := EnsureAll(ctx, js, StreamConfig{Name: "S_" + name, Replicas: 3}, BucketConfig{Name: "B_" + name, Replicas: 3}, log)
		if err != nil {
			t.Fatal(err)
		}
		si, err := r.Stream.Info(ctx)
		if err != nil || si.Config.Replicas != 3 {
			t.Fatalf("stream replicas: %+v %v", si, err)
		}
		for _, n := range []string{"KV_B_" + name, "OBJ_B_" + name + "_OBJ"} {
			s, err := js.Stream(ctx, n)
			if err != nil {
				t.Fatalf("%s: %v", n, err)
			}
			if got := s.CachedInfo().Config.Replicas; got != 3 {
				t.Fatalf("%s has %d replicas, want 3", n, got)
			}
		}
		refused(t, js, StreamConfig{Name: "S_" + name}, BucketConfig{Name: "H_" + name, Replicas: 4}, "at least 4 servers")
	})
	t.Run("single server", func(t *testing.T) {
		js := connect(testenv.StartNATS(t).URL())
		refused(t, js, StreamConfig{Name: "S_" + name, Replicas: 3}, BucketConfig{Name: "B_" + name}, "at least 3 servers")
		refused(t, js, StreamConfig{Name: "S_" + name, Replicas: MaxReplicas + 1}, BucketConfig{Name: "B_" + name}, "replicas 6 of 1..5")
		refused(t, js, StreamConfig{Name: "S_" + name}, BucketConfig{Name: "B_" + name, Replicas: -1}, "replicas -1 out of range")
	})
}

// Which JetStream API errors are configuration errors (returned at once)
// and which an outage (retried). "No suitable peers" with a peer offline
// is an outage: a JetStream cluster that has just started answers it
// until every server has reported in, and a bridge that took it for a
// configuration error stopped and never became ready (1 fleet start in 20
// in the cluster tests).
func TestIsConfigErrorAPIErrors(t *testing.T) {
	for _, tc := range []struct {
		err  *jetstream.APIError
		want bool
	}{
		{&jetstream.APIError{Code: 400, ErrorCode: jsErrNoPeers, Description: "no suitable peers for placement, peer offline"}, false},
		{&jetstream.APIError{Code: 400, ErrorCode: jsErrNoPeers, Description: "no suitable peers for placement, peer offline, insufficient storage"}, false},
		{&jetstream.APIError{Code: 400, ErrorCode: jsErrNoPeers, Description: "no suitable peers for placement"}, true},
		{&jetstream.APIError{Code: 400, ErrorCode: jsErrSubjectOverlap, Description: "subjects overlap with an existing stream"}, true},
		{&jetstream.APIError{Code: 500, ErrorCode: jsErrReplicasNotSupported, Description: "replicas > 1 not supported in non-clustered mode"}, true},
		{&jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "jetstream system temporarily unavailable"}, false},
	} {
		err := fmt.Errorf("kvstream: create stream S: %w", tc.err)
		if got := IsConfigError(err); got != tc.want {
			t.Errorf("IsConfigError(%v) = %v, want %v", err, got, tc.want)
		}
	}
}
