package kvstate

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/replicasync"
)

// The config's min_gap bounds are replicasync's (config imports no other
// package of the project and keeps its own copy): a value the router
// accepts at load is one the Syncer accepts at start, and the reverse.
func TestReplicaSyncMinGapBoundsMatch(t *testing.T) {
	for _, tc := range []struct {
		gap  time.Duration
		want bool
	}{
		{replicasync.MinMinGap, true},
		{replicasync.MinMinGap - time.Nanosecond, false},
		{replicasync.DefaultInterval, true},
		{replicasync.DefaultInterval + time.Nanosecond, false},
	} {
		doc := fmt.Sprintf("events: {nats: {url: 'nats://h:4222'}, replica_sync: {enabled: true, min_gap: %s}}\n"+
			"pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}]", tc.gap)
		cfg, err := config.ParseConfig(strings.NewReader(doc))
		if err == nil {
			err = cfg.Validate()
		}
		sync := replicasync.Config{Pool: "p", Replica: "r", MinGap: tc.gap}.WithDefaults().Validate()
		if (err == nil) != tc.want || (sync == nil) != tc.want {
			t.Errorf("min_gap %v: config %v, replicasync %v; want accepted %v", tc.gap, err, sync, tc.want)
		}
	}
}
