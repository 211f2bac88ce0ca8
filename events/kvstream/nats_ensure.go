package kvstream

import (
	"context"
	"errors"
	"log/slog"
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
			return a.Code == 400
		}
	}
	return false
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

func ensureAllOnce(ctx context.Context, js jetstream.JetStream, stream StreamConfig, bucket BucketConfig) (Resources, error) {
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
