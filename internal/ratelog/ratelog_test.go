package ratelog

import (
	"fmt"
	"testing"
	"time"
)

func TestLimiter(t *testing.T) {
	now := time.Unix(0, 0)
	l := New(time.Second, 3)
	l.now = func() time.Time { return now }
	allowed := 0
	for range 10 {
		if ok, _ := l.Allow("a"); ok {
			allowed++
		}
	}
	if allowed != 3 {
		t.Fatalf("%d lines let through in one window, want 3", allowed)
	}
	if ok, _ := l.Allow("b"); !ok {
		t.Fatal("another key is limited by the first")
	}
	now = now.Add(time.Second)
	ok, suppressed := l.Allow("a")
	if !ok || suppressed != 7 {
		t.Fatalf("next window: ok=%v suppressed=%d, want true 7", ok, suppressed)
	}
	if _, s := l.Allow("a"); s != 0 {
		t.Fatalf("suppressed count reported twice: %d", s)
	}
}

// Keys chosen by an attacker do not grow the limiter without bound.
func TestLimiterBoundsKeys(t *testing.T) {
	now := time.Unix(0, 0)
	l := New(time.Minute, 1)
	l.now = func() time.Time { return now }
	passed := 0
	for i := range 10 * maxKeys {
		if ok, _ := l.Allow(fmt.Sprint("junk-", i)); ok {
			passed++
		}
	}
	if n := len(l.keys); n > maxKeys+1 {
		t.Fatalf("%d keys tracked, want at most %d", n, maxKeys+1)
	}
	if passed > maxKeys+1 {
		t.Fatalf("%d lines let through for junk keys in one window, want at most %d", passed, maxKeys+1)
	}
	// Once their window is over, old keys make room for new ones.
	now = now.Add(time.Minute)
	if ok, _ := l.Allow("fresh"); !ok {
		t.Fatal("a new key refused after the window")
	}
}
