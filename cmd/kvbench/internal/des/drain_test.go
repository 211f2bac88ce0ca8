package des

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/workload"
)

// TestScaledInLifeCoversDrain: an instance removed by a scale-in finishes
// what it holds; the steps of that drain count in its busy time, so its
// life runs to the end of its last request, not to its removal.
func TestScaledInLifeCoversDrain(t *testing.T) {
	w := smallWorkload(t, 10)
	for i := range w.Requests {
		w.Requests[i].At = time.Duration(i) * time.Millisecond
		w.Requests[i].OutputTokens = 2000 // 2 s each on the FIFO engine
	}
	w.Fleet = []workload.FleetEvent{{At: 20 * time.Millisecond, Kind: workload.ScaleIn, Instances: 1}}
	res, err := Run(context.Background(), Config{Instances: 2, NewEngine: fifoFactory(t), Router: newRR()}, w)
	if err != nil {
		t.Fatal(err)
	}
	var busy, life time.Duration
	for _, u := range res.Utilisation {
		busy += u.Busy
		life += u.Life
		if u.Busy > u.Life {
			t.Errorf("%s: busy %v over a %v life", u.Instance, u.Busy, u.Life)
		}
	}
	if busy > life {
		t.Errorf("fleet busy %.3f", busy.Seconds()/life.Seconds())
	}
}
