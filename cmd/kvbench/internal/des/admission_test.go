package des

import (
	"context"
	"fmt"
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

// copyHold admits every request at once but request 2, which it holds
// until a warm-up copy's first token (as a per-instance budget would
// while the copy prefills), and records the copies it was told of.
type copyHold struct {
	held       []uint64
	copyFT     bool
	companions []string
}

func (q *copyHold) Arrive(id uint64, _ *workload.Request, _ time.Duration) (bool, string) {
	if id == 2 {
		q.held = append(q.held, id)
		return false, ""
	}
	return true, ""
}

func (q *copyHold) Admitted(_ time.Duration, dst []uint64) []uint64 {
	if q.copyFT {
		dst = append(dst, q.held...)
		q.held = q.held[:0]
	}
	return dst
}

func (q *copyHold) Shed(_ time.Duration, dst []Dropped) []Dropped { return dst }
func (q *copyHold) NextExpiry() (time.Duration, bool)             { return 0, false }
func (q *copyHold) FirstToken(id uint64, _ time.Duration) {
	if id&WarmTag != 0 {
		q.copyFT = true
	}
}
func (q *copyHold) Finished(uint64, time.Duration) {}
func (q *copyHold) Companion(of uint64, instance string, _ time.Duration) {
	q.companions = append(q.companions, fmt.Sprintf("%d@%s", of, instance))
}

// warmRouter sends requests 0 and 1 to the first candidate, request 1
// with a warm-up copy to the second, and the rest to the second.
type warmRouter struct{ *rrRouter }

func (r warmRouter) Pick(_ context.Context, req *RouteRequest, cands []string) (Decision, error) {
	switch req.EngineID {
	case 0:
		return Decision{Instance: cands[0], Reason: "test"}, nil
	case 1:
		return Decision{Instance: cands[0], Reason: "test", Warm: cands[1]}, nil
	}
	return Decision{Instance: cands[1], Reason: "test"}, nil
}

// TestWarmCopyAdmission: the driver tells the queue of a warm-up copy
// (Companion, once the engine has it), of its first token and end, and
// asks the queue for admissions when the copy's first token frees its
// budget — as the router's Gate does — not only at a request's.
func TestWarmCopyAdmission(t *testing.T) {
	w := smallWorkload(t, 3)
	w.Requests[0].At, w.Requests[1].At, w.Requests[2].At = 0, time.Microsecond, 2*time.Microsecond
	q := &copyHold{}
	res, err := Run(context.Background(), Config{Instances: 2, NewEngine: fifoFactory(t), Router: warmRouter{newRR()}, Admission: q}, w)
	if err != nil {
		t.Fatal(err)
	}
	if res.Warms != 1 || len(q.companions) != 1 || q.companions[0] != "1@"+res.Instances[1] {
		t.Fatalf("warms %d, companions %v; want the one copy of request 1 on %s", res.Warms, q.companions, res.Instances[1])
	}
	// The copy starts at 1 µs on the idle instance and prefills its
	// 110-token prompt by 111 µs; request 0 holds the other instance
	// until 5.11 ms, request 1 waits behind it there.
	copyFT := time.Microsecond + time.Duration(len(w.Requests[1].Tokens()))*time.Microsecond
	if o := res.Outcomes[2]; o.Err != "" || o.Queued != copyFT-w.Requests[2].At {
		t.Fatalf("request 2: err %q, queued %v, want admitted at the copy's first token (%v)", o.Err, o.Queued, copyFT-w.Requests[2].At)
	}
}
