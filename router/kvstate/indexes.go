package kvstate

import (
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/pemfile"
	"github.com/kvrouter/kvrouter/kvindex"
)

// PoolIndexes are the KV indexes of a configuration's pools, built by
// NewPoolIndexes from its index: section.
type PoolIndexes struct {
	// ByPool holds one index per pool name.
	ByPool map[string]kvindex.Index
	rdb    redis.UniversalClient // shared by the pools' Redis indexes; nil for memory
}

// Close releases the Redis connection, if any.
func (p *PoolIndexes) Close() error {
	if p.rdb != nil {
		return p.rdb.Close()
	}
	return nil
}

// ClusterStateReload bounds how long a Redis Cluster index may keep sending
// a slot range to a master that died after its replica took over. go-redis
// reloads its slot map at once on MOVED and ASK, but a dead master answers
// nothing: connection errors reload nothing, and the periodic reload is
// 60 s by default. A retry that happens to land on a live node gets MOVED
// and recovers sooner (the index's pipelines did, ~1 s after the promotion
// in deploy's TestProductionRedisClusterForms), but nothing bounds it: a
// plain cluster client writing to the dead master's slots failed for 56 s
// after the promotion there. One CLUSTER SLOTS a second costs the server
// nothing measurable (a few hundred bytes for three shards); go-redis
// reloads lazily, on the first command after the interval.
const ClusterStateReload = time.Second

// NewPoolIndexes builds one KV index per pool from cfg.Index: the memory
// backend (capacity index.capacity), or Redis (index.redis: one client
// shared by all pools, each pool under its own key prefix
// "<key_prefix>:<pool>", so pools never alias). The block size is the
// pool's routing.kv.block_size, else learned from events. nil cfg.Index
// means no index (kv_aware unavailable).
//
// The binary feeds each index from the events consumer and passes them to
// the server through Options.KV.
func NewPoolIndexes(cfg config.Config) (*PoolIndexes, error) {
	out := &PoolIndexes{ByPool: map[string]kvindex.Index{}}
	ic := cfg.Index
	if ic == nil {
		return out, nil
	}
	if ic.Backend == "redis" {
		rc := ic.Redis
		if rc == nil || len(rc.Addrs) == 0 {
			return nil, fmt.Errorf("%w: index.redis.addrs: required when index.backend is redis", config.ErrInvalidConfig)
		}
		// ContextTimeoutEnabled: a context's deadline bounds a command's
		// reads too, not only its dials and retries, so that a lookup on a
		// hung Redis ends at kvindex.DefaultRedisLookupTimeout rather than
		// after the read timeout of every retry (35 s; the consumer's
		// writes carry no deadline and keep the read timeout).
		opts := &redis.UniversalOptions{Addrs: rc.Addrs, IsClusterMode: rc.Cluster, DB: rc.DB, Username: rc.Username, Password: rc.Password,
			ContextTimeoutEnabled: true}
		if rc.TLS || rc.TLSCAFile != "" {
			opts.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
			if rc.TLSCAFile != "" {
				pool, err := pemfile.CertPool(rc.TLSCAFile)
				if errors.Is(err, pemfile.ErrNoCertificate) {
					return nil, fmt.Errorf("%w: index.redis.tls_ca_file %w", config.ErrInvalidConfig, err)
				}
				if err != nil {
					return nil, fmt.Errorf("router: index.redis.tls_ca_file: %w", err)
				}
				opts.TLSConfig.RootCAs = pool
			}
		}
		if rc.Cluster || len(rc.Addrs) > 1 { // several seeds always mean a cluster (config.RedisConfig)
			co := opts.Cluster()
			co.ClusterStateReloadInterval = ClusterStateReload
			out.rdb = redis.NewClusterClient(co)
		} else {
			out.rdb = redis.NewUniversalClient(opts)
		}
	}
	for _, p := range cfg.Pools {
		bs := 0
		if p.Routing.KV != nil {
			bs = p.Routing.KV.BlockSize
		}
		var idx kvindex.Index
		var err error
		switch ic.Backend {
		case "", "memory":
			idx, err = kvindex.NewMemory(kvindex.MemoryConfig{Model: p.Model, BlockSize: bs, Capacity: ic.Capacity})
		case "redis":
			prefix := p.Name
			if ic.Redis.KeyPrefix != "" {
				prefix = ic.Redis.KeyPrefix + ":" + p.Name
			}
			idx, err = kvindex.NewRedis(out.rdb, kvindex.RedisConfig{Prefix: prefix, Model: p.Model, BlockSize: bs, TTL: ic.Redis.TTL,
				LookupTimeout: kvindex.DefaultRedisLookupTimeout})
		default:
			err = fmt.Errorf("%w: index.backend %q: want memory or redis", config.ErrInvalidConfig, ic.Backend)
		}
		if err != nil {
			_ = out.Close()
			return nil, fmt.Errorf("router: pool %q index: %w", p.Name, err)
		}
		out.ByPool[p.Name] = idx
	}
	return out, nil
}
