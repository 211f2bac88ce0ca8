package kvindex

// Freshness tells a reader (kv_aware) how far to trust the index: whether the pool's
// event stream is being consumed, and whether an instance has gone quiet
// (a gap not yet repaired, a silent bridge). The events consumer
// implements it (see FreshnessFuncs). Methods are called on the request
// path, concurrently: they must be cheap and safe for concurrent use.
type Freshness interface {
	StreamHealthy() bool
	Stale(instance string) bool
}

// FreshnessFuncs adapts two functions to Freshness; a nil func means
// "healthy" / "not stale". For the events consumer:
//
//	kvindex.FreshnessFuncs{Healthy: c.Healthy, IsStale: func(id string) bool { return !c.Live(id) }}
type FreshnessFuncs struct {
	Healthy func() bool
	IsStale func(instance string) bool
	// Epoch, when set, is the consumer's LostEpoch (see CacheEpochs).
	Epoch func(instance string) uint64
}

var (
	_ Freshness   = FreshnessFuncs{}
	_ CacheEpochs = FreshnessFuncs{}
)

// CacheEpochs is implemented by a Freshness that counts the times each
// instance's cache was lost or could not be vouched for (cleared by the
// bridge or the engine, restarted, reported down, purged). kv_aware's
// speculative entries remember the epoch they were made in and count only
// while it lasts: a request routed just before an engine restarted must
// not make the new, empty process look as if it held that prompt.
type CacheEpochs interface {
	LostEpoch(instance string) uint64
}

// LostEpoch implements CacheEpochs; 0 without the func.
func (f FreshnessFuncs) LostEpoch(instance string) uint64 {
	if f.Epoch == nil {
		return 0
	}
	return f.Epoch(instance)
}

// StreamHealthy implements Freshness.
func (f FreshnessFuncs) StreamHealthy() bool { return f.Healthy == nil || f.Healthy() }

// Stale implements Freshness.
func (f FreshnessFuncs) Stale(instance string) bool { return f.IsStale != nil && f.IsStale(instance) }
