package config

// KVEventsWanted reports whether cfg asks for KV state: events not
// disabled, and an index: section or a pool that routes kv_aware or
// shadows. Without it the router runs without NATS.
func KVEventsWanted(cfg Config) bool {
	if cfg.Events != nil && cfg.Events.Enabled != nil && !*cfg.Events.Enabled {
		return false
	}
	if cfg.Index != nil {
		return true
	}
	for _, p := range cfg.Pools {
		if p.Routing.Strategy == StrategyKVAware || p.Routing.Shadow {
			return true
		}
	}
	return false
}

// DiscoverEnabled reports events.discover_instances (default true).
func DiscoverEnabled(cfg Config) bool {
	return cfg.Events == nil || cfg.Events.DiscoverInstances == nil || *cfg.Events.DiscoverInstances
}
