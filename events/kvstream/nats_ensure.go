package kvstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ErrConfig marks a stream, bucket or object store configuration that can
// never be made: a negative limit, or one JetStream rejects (another
// stream already holds the subjects, an invalid setting). Retrying cannot
// help, so EnsureAll returns it rather than loop.
var ErrConfig = errors.New("kvstream: invalid stream or bucket configuration")

// IsConfigError reports whether err is a configuration problem (ErrConfig,
// a name the client library rejects, or a JetStream API error with status
// 400, which the server uses for requests it rejects as invalid: subject
// overlap, bad config) rather than an outage (timeouts, no responders,
// JetStream unavailable: 503).
func IsConfigError(err error) bool {
	for _, e := range []error{ErrConfig, jetstream.ErrInvalidStreamName, jetstream.ErrStreamNameRequired,
		jetstream.ErrInvalidBucketName, jetstream.ErrInvalidSubject, jetstream.ErrKeyValueConfigRequired} {
		if errors.Is(err, e) {
			return true
		}
	}
	var je jetstream.JetStreamError
	if errors.As(err, &je) {
		if a := je.APIError(); a != nil {
			if a.ErrorCode == jsErrNoPeers && strings.Contains(a.Description, "peer offline") {
				// Enough servers, but one the replicas need is offline
				// (restarting, or not yet known to a cluster just
				// started): an outage, which passes.
				return false
			}
			return a.Code == 400 || a.ErrorCode == jsErrReplicasNotSupported
		}
	}
	return false
}

// JetStream API error codes (nats-server server/errors.json; nats.go has
// no constants for them): replicas > 1 asked of a server that is not
// clustered (status 500, yet no retry can help), and no set of servers
// able to hold the replicas (status 400: fewer servers than replicas).
const (
	jsErrReplicasNotSupported = 10074
	jsErrNoPeers              = 10005
)

// replicasHint explains a refused creation that asked for more replicas
// than the servers can give.
func replicasHint(err error, replicas int) string {
	var je jetstream.JetStreamError
	if replicas <= 1 || !errors.As(err, &je) || je.APIError() == nil {
		return ""
	}
	switch je.APIError().ErrorCode {
	case jsErrReplicasNotSupported, jsErrNoPeers:
		return fmt.Sprintf(" (%d replicas need a JetStream cluster of at least %d servers; set stream replicas to 1 for a single server)", replicas, replicas)
	}
	return ""
}

// Resources are the JetStream resources the bridge and the consumer share.
type Resources struct {
	Stream      jetstream.Stream
	Bucket      jetstream.KeyValue
	ObjectStore jetstream.ObjectStore
}

// EnsureAll makes (or finds) the events stream, the snapshot bucket and
// the snapshot object store. Outages are retried with backoff (100ms
// doubling to 5s) until ctx is done, so that a bridge or router started
// before NATS comes up by itself; a configuration error (IsConfigError) is
// returned at once, since it will not go away. It returns ctx.Err() when
// ctx ends first.
func EnsureAll(ctx context.Context, js jetstream.JetStream, stream StreamConfig, bucket BucketConfig, log *slog.Logger) (Resources, error) {
	if log == nil {
		log = slog.Default()
	}
	backoff := 100 * time.Millisecond
	for {
		r, err := ensureAllOnce(ctx, js, stream, bucket)
		if err == nil {
			return r, nil
		}
		if IsConfigError(err) {
			return Resources{}, err
		}
		if ctx.Err() != nil {
			return Resources{}, ctx.Err()
		}
		log.Warn("kvstream: stream or bucket not ready, retrying", "err", err, "backoff", backoff)
		select {
		case <-ctx.Done():
			return Resources{}, ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// ensureAttemptTimeout bounds one EnsureAll attempt. A JetStream cluster
// drops API requests it cannot serve yet (no meta leader, a stream being
// placed), and nats.go waits for a reply until the context's deadline: a
// caller's far deadline (or none, then nats.go's 5s) must not stall the
// retries. Ten seconds is twice a cluster's usual leader election.
const ensureAttemptTimeout = 10 * time.Second

func ensureAllOnce(ctx context.Context, js jetstream.JetStream, stream StreamConfig, bucket BucketConfig) (Resources, error) {
	ctx, cancel := context.WithTimeout(ctx, ensureAttemptTimeout)
	defer cancel()
	var r Resources
	var err error
	if r.Stream, err = EnsureStream(ctx, js, stream); err != nil {
		return Resources{}, err
	}
	if r.Bucket, err = EnsureBucket(ctx, js, bucket); err != nil {
		return Resources{}, err
	}
	if r.ObjectStore, err = EnsureObjectStore(ctx, js, bucket); err != nil {
		return Resources{}, err
	}
	return r, nil
}
