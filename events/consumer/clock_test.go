package consumer

import (
	"testing"
	"time"
)

// An event's time is its JetStream store time, read from the NATS
// server's clock. A server whose clock runs ahead of the router's must
// not keep an instance live for longer than StaleAfter after its last
// event as the router counts: the instance's last sighting is never later
// than the router's own now.
func TestSeenAtServerClockAhead(t *testing.T) {
	c := &Consumer{cfg: Config{StaleAfter: time.Second}}
	in := &inst{status: InstanceStatus{Instance: "e0", State: StateStale}}
	now := time.Now()
	c.seenAt(in, now.Add(time.Minute), now) // stored "a minute from now"
	if in.status.State != StateLive {
		t.Fatalf("state %v after an event, want live", in.status.State)
	}
	if in.lastSeen.After(now) {
		t.Fatalf("last seen %v after the router's now: the instance would stay live until %v, not %v",
			in.lastSeen.Sub(now), in.lastSeen.Add(c.cfg.StaleAfter).Sub(now), c.cfg.StaleAfter)
	}
}
