package des

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/workload"
)

// headQueue is an Admission that queues every arrival and admits in
// arrival order from Admitted, except that request 0 never fits: it holds
// the others back until it expires at expireAt.
type headQueue struct {
	waiting  []uint64
	expireAt time.Duration
}

func (q *headQueue) Arrive(id uint64, _ *workload.Request, _ time.Duration) (bool, string) {
	q.waiting = append(q.waiting, id)
	return false, ""
}

func (q *headQueue) Admitted(_ time.Duration, dst []uint64) []uint64 {
	if len(q.waiting) > 0 && q.waiting[0] == 0 {
		return dst
	}
	dst = append(dst, q.waiting...)
	q.waiting = q.waiting[:0]
	return dst
}

func (q *headQueue) Shed(now time.Duration, dst []Dropped) []Dropped {
	if len(q.waiting) > 0 && q.waiting[0] == 0 && now >= q.expireAt {
		q.waiting = q.waiting[1:]
		dst = append(dst, Dropped{ID: 0, Reason: "deadline"})
	}
	return dst
}

func (q *headQueue) NextExpiry() (time.Duration, bool) {
	if len(q.waiting) > 0 && q.waiting[0] == 0 {
		return q.expireAt, true
	}
	return 0, false
}

func (q *headQueue) FirstToken(uint64, time.Duration)        {}
func (q *headQueue) Finished(uint64, time.Duration)          {}
func (q *headQueue) Companion(uint64, string, time.Duration) {}

// TestFlowQueueDispatchesOnArrivalAndExpiry: the driver asks the queue for
// admissions after an arrival and after an expiry, as the router's Gate
// does, not only when an engine frees capacity: the request behind an
// expiring head goes at the expiry, and an arrival the queue can admit at
// once goes at its arrival, though nothing is running either time.
func TestFlowQueueDispatchesOnArrivalAndExpiry(t *testing.T) {
	w := smallWorkload(t, 3)
	w.Requests[0].At, w.Requests[1].At, w.Requests[2].At = 0, time.Millisecond, 50*time.Millisecond
	q := &headQueue{expireAt: 5 * time.Millisecond}
	res, err := Run(context.Background(), Config{Instances: 1, NewEngine: fifoFactory(t), Router: newRR(), Admission: q}, w)
	if err != nil {
		t.Fatal(err)
	}
	o := res.Outcomes
	if o[0].Shed != "deadline" || o[0].Finish != 5*time.Millisecond {
		t.Fatalf("head: shed %q at %v, want deadline at 5ms", o[0].Shed, o[0].Finish)
	}
	if o[1].Err != "" || o[1].Queued != 4*time.Millisecond {
		t.Fatalf("behind the head: err %q, queued %v, want admitted at the expiry (4ms)", o[1].Err, o[1].Queued)
	}
	if o[2].Err != "" || o[2].Queued != 0 {
		t.Fatalf("later arrival: err %q, queued %v, want admitted on arrival", o[2].Err, o[2].Queued)
	}
}
