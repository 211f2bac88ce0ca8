package main

import (
	"strings"
	"testing"
	"time"
)

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
