package main

import (
	"strings"
	"testing"
	"time"
)

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

// An instance a shared index holds not live (a hole pending, being
// repaired) has the consumer's state "live" with index_unsynced set: the
// table printed "live", as for one kv_aware counts. It prints "unsynced".
func TestInstancesTableUnsynced(t *testing.T) {
	now := time.Now()
	rows := []instanceRow{
		{Pool: "llama", Instance: "e0", KV: &kvInstance{Instance: "e0", State: "live", IndexUnsynced: true, Blocks: map[string]int{"gpu": 2150}}},
		{Pool: "llama", Instance: "e1", KV: &kvInstance{Instance: "e1", State: "live", Blocks: map[string]int{"gpu": 1498}}},
	}
	var b strings.Builder
	if err := writeInstancesTable(&b, rows, nil, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(b.String(), "\n")
	if len(lines) < 3 || !strings.Contains(lines[1], "unsynced") || !strings.Contains(lines[2], "live") || strings.Contains(lines[2], "unsynced") {
		t.Fatalf("table:\n%s", b.String())
	}
}
