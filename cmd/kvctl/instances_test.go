package main

import "testing"

// The state cell says why an instance is not live when the router knows:
// the consumer's "live" with its shared-index state under repair is not
// live for kv_aware.
func TestStateCell(t *testing.T) {
	tests := []struct {
		state, notLive, want string
	}{
		{"live", "", "live"},
		{"stale", "silent", "stale (silent)"},
		{"stale", "hole", "stale (hole)"},
		{"stale", "engine_down", "stale (engine_down)"},
		{"live", "index_unsynced", "stale (index_unsynced)"},
		{"purged", "purged", "purged"},
		{"unknown", "", "unknown"},
		{"", "", "-"},
	}
	for _, tc := range tests {
		if got := stateCell(&kvInstance{State: tc.state, NotLive: tc.notLive}); got != tc.want {
			t.Errorf("state %q not_live %q: %q, want %q", tc.state, tc.notLive, got, tc.want)
		}
	}
}
