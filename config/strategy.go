package config

// StrategyNames lists the strategies NewStrategy knows.
func StrategyNames() []string {
	return []string{StrategyRandom, StrategyRoundRobin, StrategyLeastOutstanding, StrategyPrefixAware, StrategyKVAware}
}

// KnownStrategy reports whether name is one of StrategyNames.
func KnownStrategy(name string) bool {
	for _, n := range StrategyNames() {
		if n == name {
			return true
		}
	}
	return false
}

// StrategyKVAware is the exact cache-state strategy: it scores each
// candidate by the prompt blocks it really holds, per tier, blended with
// load, and falls back to prefix_aware where the index knows nothing.
const StrategyKVAware = "kv_aware"
