package main

import (
	"bytes"
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/events"
)

func TestLRUEngineEvents(t *testing.T) {
	const bs = 2
	toks := func(n int) []uint32 { return make([]uint32, n*bs) }
	e := newLRUEngine(4)
	evs := e.serve(nil, []uint64{1, 2, 3}, toks(3), bs)
	if len(evs) != 1 || evs[0].Kind != events.BlockStored || !slices.Equal(evs[0].BlockHashes, []uint64{1, 2, 3}) || evs[0].HasParent {
		t.Fatalf("first prompt: %+v", evs)
	}
	// 1 and 2 are hits; 5 and 6 need room for one more: the least recent
	// block goes, which is the chain's end (3), not its head.
	evs = e.serve(nil, []uint64{1, 2, 5, 6}, toks(4), bs)
	if len(evs) != 2 || evs[0].Kind != events.BlockRemoved || !slices.Equal(evs[0].BlockHashes, []uint64{3}) {
		t.Fatalf("second prompt: %+v", evs)
	}
	if st := evs[1]; st.Kind != events.BlockStored || !slices.Equal(st.BlockHashes, []uint64{5, 6}) || !st.HasParent || st.ParentHash != 2 || len(st.TokenIDs) != 2*bs {
		t.Fatalf("second prompt's store: %+v", st)
	}
	if evs = e.serve(nil, []uint64{1, 2, 5, 6}, toks(4), bs); len(evs) != 0 {
		t.Fatalf("a prompt held in full emits %+v", evs)
	}
	// A prompt larger than the cache keeps its head.
	evs = e.serve(nil, []uint64{7, 8, 9, 10, 11, 12}, toks(6), bs)
	if st := evs[len(evs)-1]; !slices.Equal(st.BlockHashes, []uint64{7, 8, 9, 10}) {
		t.Fatalf("oversized prompt stored %v", st.BlockHashes)
	}
}

func TestIndexerReplay(t *testing.T) {
	var out, errb bytes.Buffer
	if err := run(context.Background(), []string{"indexer", "--limit", "300", "--instances", "2,8", "--trace-per", "2"}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	rows := 0
	for _, line := range strings.Split(out.String(), "\n") {
		f := strings.Split(line, "|")
		if len(f) < 10 || (strings.TrimSpace(f[1]) != "2" && strings.TrimSpace(f[1]) != "8") {
			continue
		}
		rows++
		// lookups = requests of the copies played; something was stored.
		if want := map[string]string{"2": "300", "8": "1200"}[strings.TrimSpace(f[1])]; strings.TrimSpace(f[3]) != want {
			t.Errorf("row %q: %s lookups, want %s", line, f[3], want)
		}
		if strings.TrimSpace(f[5]) == "0" {
			t.Errorf("row %q: nothing stored", line)
		}
		// The batched replay ran the same operations and timed them.
		if v, err := strconv.ParseFloat(strings.TrimSpace(f[8]), 64); err != nil || v <= 0 {
			t.Errorf("row %q: batched ops/CPU-s %q", line, f[8])
		}
	}
	if rows != 2 {
		t.Fatalf("want 2 rows, got:\n%s", out.String())
	}
	if err := run(context.Background(), []string{"indexer", "--workload", "chat"}, &out, &errb); err == nil {
		t.Fatal("a generated workload was accepted")
	}
}
