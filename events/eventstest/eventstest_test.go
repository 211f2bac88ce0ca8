package eventstest

import "testing"

// Every capture file of engine messages loads, from this package's
// directory as from any other.
func TestCapturedPayloads(t *testing.T) {
	for _, name := range []string{"array.jsonl", "map.jsonl", "dp.array.jsonl"} {
		if ps := CapturedPayloads(t, name); len(ps[0]) == 0 {
			t.Errorf("%s: first payload empty", name)
		}
	}
}
