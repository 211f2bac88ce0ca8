package replicasync

import (
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// gatedDialer dials only while open: a connection that cannot reconnect
// until the test says so.
type gatedDialer struct{ open atomic.Bool }

func (d *gatedDialer) Dial(network, address string) (net.Conn, error) {
	if !d.open.Load() {
		return nil, errors.New("gated")
	}
	return (&net.Dialer{Timeout: 2 * time.Second}).Dial(network, address)
}

// A replica back from a NATS outage catches up at once, as a joining one
// does: what its peers sent while it was away (a changed counter, a
// speculative announcement) reached no one, and without a hello it would
// wait for their next heartbeat (a minute here). The server is restarted;
// c reconnects only after a is back and has sent its changes, so that
// only c's hello can bring them.
func TestReconnectCatchesUp(t *testing.T) {
	ns := testenv.StartNATS(t)
	pool := testenv.UniqueName(t)
	fastReconnect := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond), nats.ReconnectJitter(0, 0)}
	a := startReplicaOn(t, testenv.Connect(t, ns.URL(), fastReconnect...), noHeartbeat(pool, "a"))
	gate := &gatedDialer{}
	gate.open.Store(true)
	c := startReplicaOn(t, testenv.Connect(t, ns.URL(), append(fastReconnect, nats.SetCustomDialer(gate))...), noHeartbeat(pool, "c"))
	a.set(Load{Instance: "i0", InFlight: 1})
	testenv.WaitFor(t, 10*time.Second, "c hears a", func() bool {
		f, _, _ := c.PeerLoad("i0")
		return f == 1
	})

	gate.open.Store(false)
	ns.Shutdown()
	ns.WaitForShutdown()
	testenv.WaitFor(t, 10*time.Second, "both disconnected", func() bool {
		return !a.cfg.Conn.IsConnected() && !c.cfg.Conn.IsConnected()
	})
	ns = ns.Restart(t)
	testenv.WaitFor(t, 10*time.Second, "a reconnected", a.cfg.Conn.IsConnected)
	keys := []kvindex.Key{41, 42, 43}
	a.set(Load{Instance: "i0", InFlight: 5})
	a.Speculate("i0", keys, time.Minute)
	time.Sleep(100 * time.Millisecond) // several of a's interval sends, to no one
	if err := a.cfg.Conn.FlushTimeout(5 * time.Second); err != nil {
		t.Fatal(err)
	}

	gate.open.Store(true)
	testenv.WaitFor(t, 10*time.Second, "c reconnected", c.cfg.Conn.IsConnected)
	back := time.Now()
	testenv.WaitFor(t, 10*time.Second, "c catches up after its reconnect", func() bool {
		f, _, _ := c.PeerLoad("i0")
		return f == 5 && c.PeerExtend(keys, 0, "i0", 0) == 3
	})
	t.Logf("caught up %v after the reconnect", time.Since(back))
}
