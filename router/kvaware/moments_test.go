package kvaware

import (
	"sync"
	"testing"
	"time"
)

// The pending tokens and requests are read as one moment's: while
// requests of 100 tokens each come and go on several goroutines, no read
// pairs a request with no tokens or tokens with no request (two words
// read apart could: a release between the reads), and all gone leaves 0.
func TestPendingCounterOneMoment(t *testing.T) {
	var pc pendingCounter
	if !pc.add(100) {
		t.Fatal("the first request is not reported first")
	}
	if pc.add(100) {
		t.Fatal("a second request reported first")
	}
	pc.sub(100)
	pc.sub(100)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				pc.add(100)
				pc.sub(100)
			}
		})
	}
	for range 200000 {
		if tok, reqs := pc.load(); tok != 100*reqs || reqs < 0 || reqs > 4 {
			close(stop)
			wg.Wait()
			t.Fatalf("read %d tokens with %d requests", tok, reqs)
		}
	}
	close(stop)
	wg.Wait()
	if tok, reqs := pc.load(); tok != 0 || reqs != 0 {
		t.Fatalf("all gone: %d tokens, %d requests", tok, reqs)
	}
}

// A commit whose sample is older than the last one folded (decisions
// racing to commit) leaves the busy average and its clock as they were:
// the clock set back counted the time between the two again at the next
// sample.
func TestUtilisationLateSample(t *testing.T) {
	t0 := time.Unix(1000, 0)
	share := func(v float64) func(time.Time) float64 { return func(time.Time) float64 { return v } }
	var inOrder, late utilisation
	inOrder.read(t0, share(1), true)
	inOrder.read(t0.Add(2*time.Second), share(0), true)
	want := inOrder.read(t0.Add(4*time.Second), share(0), true)
	late.read(t0, share(1), true)
	late.read(t0.Add(2*time.Second), share(0), true)
	if got := late.read(t0.Add(time.Second), share(1), true); got != late.rho || late.at != t0.Add(2*time.Second) {
		t.Fatalf("a late sample moved the clock to %v (average %v)", late.at, got)
	}
	if got := late.read(t0.Add(4*time.Second), share(0), true); got != want {
		t.Fatalf("average %v after a late sample, %v without it", got, want)
	}
}
