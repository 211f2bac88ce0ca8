package kvaware

import (
	"sync"
	"testing"
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
