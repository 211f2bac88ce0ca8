// Package ratelog bounds repetitive log lines: a flood of one kind of
// fault (junk heartbeats, a library retrying a dead server) must cost a
// few lines per interval, not one per occurrence, while every occurrence
// is still counted by the caller's metric.
package ratelog

import (
	"sync"
	"time"
)

// maxKeys bounds the distinct keys tracked; beyond it keys share one
// bucket, so a caller that keys by attacker-chosen strings stays bounded.
const maxKeys = 1024

// overflowKey is the shared bucket of keys beyond maxKeys.
const overflowKey = "\x00overflow"

// Limiter lets through at most Burst lines per key per Every; the zero
// value is not usable, build it with New. Safe for concurrent use.
type Limiter struct {
	every time.Duration
	burst int
	now   func() time.Time

	// mu guards keys and swept.
	mu    sync.Mutex
	keys  map[string]*window
	swept time.Time // last forgetOld: at most once per window, so a flood of new keys costs O(1) each
}

type window struct {
	start      time.Time
	n          int // lines let through in the window
	suppressed int // lines held back since the last one let through
}

// New returns a Limiter letting burst lines per key through every interval.
func New(every time.Duration, burst int) *Limiter {
	return &Limiter{every: every, burst: max(burst, 1), now: time.Now, keys: map[string]*window{}}
}

// Allow reports whether a line under key may be written now, and how many
// lines under it were suppressed since the last one written (to log with
// it, so that nothing is silently lost).
func (l *Limiter) Allow(key string) (ok bool, suppressed int) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.keys[key]
	if w == nil {
		if len(l.keys) >= maxKeys && now.Sub(l.swept) >= l.every {
			l.forgetOld(now)
			l.swept = now
		}
		if len(l.keys) >= maxKeys {
			key = overflowKey
			w = l.keys[key]
		}
		if w == nil {
			w = &window{start: now}
			l.keys[key] = w
		}
	}
	if now.Sub(w.start) >= l.every {
		w.start, w.n = now, 0
	}
	if w.n >= l.burst {
		w.suppressed++
		return false, 0
	}
	w.n++
	s := w.suppressed
	w.suppressed = 0
	return true, s
}

// forgetOld drops keys whose window ended with nothing held back; l.mu held.
func (l *Limiter) forgetOld(now time.Time) {
	for k, w := range l.keys {
		if now.Sub(w.start) >= l.every && w.suppressed == 0 {
			delete(l.keys, k)
		}
	}
}
