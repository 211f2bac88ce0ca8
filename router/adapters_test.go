package router_test

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// TestDiscoveredAdaptersGained: discovery reports when an instance gains
// an adapter (the health loop then wakes the pool's queue, where requests
// for it may be waiting), not when it loses one or the list repeats, and
// configured adapters are never lost.
func TestDiscoveredAdaptersGained(t *testing.T) {
	in, err := router.NewInstance("i-0", "http://i-0", "configured")
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		names  []string
		gained bool
		want   []string
	}{
		{[]string{"a"}, true, []string{"a", "configured"}},
		{[]string{"a"}, false, []string{"a", "configured"}},
		{[]string{"a", "b"}, true, []string{"a", "b", "configured"}},
		{[]string{"b"}, false, []string{"b", "configured"}},
		{nil, false, []string{"configured"}},
		{[]string{"configured"}, false, []string{"configured"}},
		{[]string{"a"}, true, []string{"a", "configured"}},
	}
	for i, st := range steps {
		if got := in.SetDiscoveredAdapters(st.names); got != st.gained {
			t.Errorf("step %d %v: gained %v, want %v", i, st.names, got, st.gained)
		}
		if got := in.Adapters(); !slices.Equal(got, st.want) {
			t.Errorf("step %d: adapters %v, want %v", i, got, st.want)
		}
	}
}
