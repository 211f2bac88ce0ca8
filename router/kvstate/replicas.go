package kvstate

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
)

// PeerFreshness is a pool's Freshness with replica sync: the consumer's
// freshness and the pool's Syncer, whose methods make it the router's
// PeerState (router/kvaware/kvaware_peers.go).
type PeerFreshness struct {
	kvindex.FreshnessFuncs
	*replicasync.Syncer
}

// replicaSync is the events pipeline's replica sync (events.replica_sync):
// one Syncer per pool on the pipeline's NATS connection, sharing one set
// of metrics.
type replicaSync struct {
	once sync.Once // guards metrics creation
	m    *replicasync.Metrics
	err  error

	mu      sync.Mutex // guards syncers
	syncers map[string]*replicasync.Syncer
}

// withReplicaSync returns the pool's Freshness, with the pool's Syncer
// started when events.replica_sync is enabled (mu held by the caller).
func (k *Pipeline) withReplicaSync(pc config.PoolConfig, cons *consumer.Consumer, fresh kvindex.FreshnessFuncs) (kvindex.Freshness, error) {
	var rc *config.ReplicaSyncConfig
	if k.cfg.Events != nil {
		rc = k.cfg.Events.ReplicaSync
	}
	if rc == nil || !rc.Enabled {
		return fresh, nil
	}
	rs := &k.replicas
	rs.once.Do(func() { rs.m, rs.err = replicasync.NewMetrics(k.opts.Registerer) })
	if rs.err != nil {
		return nil, fmt.Errorf("router: register replica sync metrics: %w", rs.err)
	}
	s, err := replicasync.New(replicasync.Config{
		Conn: k.conn, Pool: pc.Name, Replica: rc.Replica,
		Interval: rc.Interval, MinGap: rc.MinGap, NoEarlySend: rc.DisableEarlySend, Heartbeat: rc.Heartbeat, PeerTimeout: rc.PeerTimeout,
		MaxMessageBytes: rc.MaxMessageBytes, MaxBytesPerSecond: rc.MaxBytesPerSecond,
		Epoch: cons.LostEpoch, Metrics: rs.m, Logger: k.log, Sequence: rc.Sequence,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: events.replica_sync: %w", config.ErrInvalidConfig, err)
	}
	rs.mu.Lock()
	if rs.syncers == nil {
		rs.syncers = map[string]*replicasync.Syncer{}
	}
	rs.syncers[pc.Name] = s
	rs.mu.Unlock()
	k.wg.Go(func() {
		if err := s.Run(k.ctx); err != nil && !errors.Is(err, context.Canceled) {
			k.log.Error("replica sync stopped", "pool", pc.Name, "err", err)
		}
	})
	k.log.Info("replica sync on", "pool", pc.Name, "replica", s.Replica())
	return PeerFreshness{FreshnessFuncs: fresh, Syncer: s}, nil
}

// ReplicaPeers lists the pool's peer replicas as replica sync sees them
// (false when the pool has no sync).
func (k *Pipeline) ReplicaPeers(pool string) ([]replicasync.PeerStatus, bool) {
	k.replicas.mu.Lock()
	s := k.replicas.syncers[pool]
	k.replicas.mu.Unlock()
	if s == nil {
		return nil, false
	}
	return s.Peers(), true
}
