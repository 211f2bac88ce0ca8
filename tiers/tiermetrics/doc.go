// Package tiermetrics is the Prometheus side of package tiers: per instance
// and tier, the blocks held, stored and evicted as the router's index saw
// them, and a bounded counter of media not in the tier table. It lives apart
// from tiers so that tiers (imported by the codec's users, the index and the
// simulator) stays standard-library only; the router's events pipeline feeds
// it from what its index applied.
package tiermetrics
