package report

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
)

// Progress draws a one-line progress bar, redrawn at most every 100 ms. It
// draws nothing when disabled (stderr is not a terminal), so logs and CI
// output stay clean.
type Progress struct {
	w       io.Writer
	enabled bool
	label   string
	// mu guards last and start: Update may be called from a driver callback
	// while Done runs on another goroutine.
	mu    sync.Mutex
	last  time.Time
	start time.Time
}

// NewProgress returns a bar on f, enabled only when f is a terminal.
func NewProgress(f *os.File, label string) *Progress {
	return &Progress{w: f, enabled: IsTerminal(f), label: label, start: time.Now()}
}

// NewProgressTo returns a bar on w, enabled as told (for tests).
func NewProgressTo(w io.Writer, enabled bool, label string) *Progress {
	return &Progress{w: w, enabled: enabled, label: label, start: time.Now()}
}

// IsTerminal reports whether f is a character device (a TTY).
func IsTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// Update redraws the bar for done of total.
func (p *Progress) Update(done, total int) {
	if p == nil || !p.enabled || total <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if done < total && now.Sub(p.last) < 100*time.Millisecond {
		return
	}
	p.last = now
	const width = 30
	filled := min(width*done/total, width)
	fmt.Fprintf(p.w, "\r%-22s [%s%s] %3d%% %d/%d %s", p.label, strings.Repeat("#", filled), strings.Repeat(".", width-filled),
		100*done/total, done, total, now.Sub(p.start).Round(100*time.Millisecond))
}

// Done ends the bar's line.
func (p *Progress) Done() {
	if p == nil || !p.enabled {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintln(p.w)
}
