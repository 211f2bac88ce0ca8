package kvstate

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/replicasync"
)

// bound is a value of an events.replica_sync duration and whether both
// the config and the Syncer accept it.
type bound struct {
	d    time.Duration
	want bool
}

// checkBounds holds a duration field's bounds in the config (which
// imports no other package of the project and keeps its own copy) equal
// to replicasync's: a value the router accepts at load is one the Syncer
// accepts at start, and the reverse.
func checkBounds(t *testing.T, field string, set func(*replicasync.Config, time.Duration), bs []bound) {
	t.Helper()
	for _, tc := range bs {
		doc := fmt.Sprintf("events: {nats: {url: 'nats://h:4222'}, replica_sync: {enabled: true, %s: %s}}\n"+
			"pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}]", field, tc.d)
		cfg, err := config.ParseConfig(strings.NewReader(doc))
		if err == nil {
			err = cfg.Validate()
		}
		c := replicasync.Config{Pool: "p", Replica: "r"}
		set(&c, tc.d)
		sync := c.WithDefaults().Validate()
		if (err == nil) != tc.want || (sync == nil) != tc.want {
			t.Errorf("%s %v: config %v, replicasync %v; want accepted %v", field, tc.d, err, sync, tc.want)
		}
	}
}

func TestReplicaSyncMinGapBoundsMatch(t *testing.T) {
	checkBounds(t, "min_gap", func(c *replicasync.Config, d time.Duration) { c.MinGap = d }, []bound{
		{replicasync.MinMinGap, true},
		{replicasync.MinMinGap - time.Nanosecond, false},
		{replicasync.DefaultInterval, true},
		{replicasync.DefaultInterval + time.Nanosecond, false},
	})
}

// sequence: min_gap + a hop .. MaxSequence, 0 off.
func TestReplicaSyncSequenceBoundsMatch(t *testing.T) {
	least := replicasync.DefaultMinGap + replicasync.MinMinGap
	checkBounds(t, "sequence", func(c *replicasync.Config, d time.Duration) { c.Sequence = d }, []bound{
		{0, true},
		{least, true},
		{least - time.Nanosecond, false},
		{replicasync.MaxSequence, true},
		{replicasync.MaxSequence + time.Nanosecond, false},
	})
}
