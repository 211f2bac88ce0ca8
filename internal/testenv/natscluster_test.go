package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A 3-node cluster holds a 3-replica stream; with its leader killed, the
// other two elect a new one and keep every acknowledged message, and the
// killed node catches up when it returns.
func TestNATSClusterSurvivesLeaderKill(t *testing.T) {
	c := StartNATSCluster(t, 3)
	nc := Connect(t, c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := Context(t, time.Minute)
	name := UniqueName(t)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Replicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	publish := func(n int) {
		for i := 0; i < n; i++ {
			for {
				pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				_, err := js.Publish(pctx, name+".a", []byte("x"))
				cancel()
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					t.Fatalf("publish %d: %v", i, err)
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	publish(100)
	leader := c.StreamLeader(name)
	if leader < 0 {
		t.Fatal("no stream leader")
	}
	c.Kill(leader)
	publish(100)
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 200 {
		t.Fatalf("stream holds %d messages after the leader's kill, want 200", info.State.Msgs)
	}
	if l := c.StreamLeader(name); l < 0 || l == leader {
		t.Fatalf("stream leader after the kill: %d (killed %d)", l, leader)
	}
	c.Restart(leader)
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, err = s.Info(ctx)
		if err == nil && info.Cluster != nil && len(info.Cluster.Replicas) == 2 {
			current := 0
			for _, p := range info.Cluster.Replicas {
				if p.Current {
					current++
				}
			}
			if current == 2 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("restarted node never caught up: %+v %v", info.Cluster, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
