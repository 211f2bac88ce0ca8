package test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// TestE2EBusyInstanceNeverReloaded: a busy engine behind a real bridge,
// heartbeating every 100 ms while it publishes, through the bridge's
// resyncs: an oversize engine message (folded into the bridge's table,
// then a resync of 25,000 blocks in chunks after its clear; meanwhile the
// bridge's heartbeats carry that message's engine seq beside the stream
// seq of the message before it) and a bridge restart (its start-up
// resync). Nothing is lost, so the router must never count a gap or a
// loss, never reload the instance's snapshot after its first load, and
// read it live throughout, its index ending equal to the engine's.
func TestE2EBusyInstanceNeverReloaded(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	o := rigOpts{snapInterval: 50 * time.Millisecond}
	r := newRig(t, o)
	reg := prometheus.NewRegistry()
	c, a, _ := r.startConsumer(consumer.Config{Registerer: reg})
	loads := func() float64 { return testenv.Metric(t, reg, "kvrouter_events_snapshot_loads_total", nil) }
	sent := [][]byte{ps[0]}
	r.publish(ps[0])
	waitTable(t, a, r.instance, reference(t, sent...))
	testenv.WaitFor(t, 10*time.Second, "live", func() bool { return c.Live(r.instance) })
	first := loads()

	var notLive, samples atomic.Int64
	stop := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
			samples.Add(1)
			if !c.Live(r.instance) {
				notLive.Add(1)
			}
		}
	})
	for round := range 4 {
		for _, p := range ps[1:] {
			r.publish(p)
			sent = append(sent, p)
			time.Sleep(10 * time.Millisecond) // busy, across a score of heartbeats
		}
		switch round {
		case 0:
			big := oversizeMessages(t)
			r.publish(big...)
			sent = append(sent, big...)
		case 1:
			r.waitPublished(uint64(len(sent)))
			if s := r.stats(); s.OversizeResyncs != 1 {
				t.Fatalf("bridge stats %+v: want the oversize message's resync", s)
			}
			r.stopBridge()
			r.startBridge(o)
		}
	}
	want := reference(t, sent...)
	waitTable(t, a, r.instance, want)
	time.Sleep(300 * time.Millisecond) // heartbeats after the last message
	close(stop)
	sampler.Wait()

	st := c.Instances()[0]
	if st.Gaps != 0 || st.ReplayLost != 0 || st.NotLive != "" {
		t.Fatalf("consumer: gaps %d, replay lost %d, not live %q: want none, nothing was lost", st.Gaps, st.ReplayLost, st.NotLive)
	}
	if n := loads(); n != first {
		t.Fatalf("%v snapshot loads after the first %v: want none, nothing was lost", n-first, first)
	}
	if n := notLive.Load(); n != 0 {
		t.Fatalf("not live in %d of %d samples while busy", n, samples.Load())
	}
	if s := r.stats(); s.Clears != 1 {
		t.Fatalf("restarted bridge's stats %+v: want its start-up resync's clear", s)
	}
	t.Logf("%d messages, %d liveness samples, engine %d blocks; consumer at engine seq %d, %d clears", len(sent), samples.Load(), len(want), st.LastSeq, st.Clears)
}
