package report

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
)

// Progress draws a one-line progress bar on a terminal, redrawn at most
// every 100 ms. Elsewhere (a log file, CI) it writes a plain line every
// PlainEvery instead, so a long run is not silent for minutes, and no
// carriage returns reach the log.
type Progress struct {
	w       io.Writer
	enabled bool // a terminal: the redrawn bar
	plain   bool // not a terminal: a line every PlainEvery
	label   string
	// mu guards last and start: Update may be called from a driver callback
	// while Done runs on another goroutine.
	mu    sync.Mutex
	last  time.Time
	start time.Time
}

// NewProgress returns a bar on f, enabled only when f is a terminal.
func NewProgress(f *os.File, label string) *Progress {
	tty := IsTerminal(f)
	return &Progress{w: f, enabled: tty, plain: !tty, label: label, start: time.Now()}
}

// PlainEvery is how often a progress line is written when the output is
// not a terminal: often enough that a watcher sees the run move, rarely
// enough that a minute of it is a dozen lines.
const PlainEvery = 5 * time.Second

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
	if p == nil || total <= 0 || (!p.enabled && !p.plain) {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if p.plain {
		if p.last.IsZero() {
			p.last = p.start
		}
		if done < total && now.Sub(p.last) >= PlainEvery {
			p.last = now
			fmt.Fprintf(p.w, "%s: %d/%d requests (%d%%), %s\n", p.label, done, total, 100*done/total, now.Sub(p.start).Round(time.Second))
		}
		return
	}
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
