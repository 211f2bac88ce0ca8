package testenv

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
)

// Logs collects a slog JSON handler's output for a test to read; safe for
// concurrent use.
type Logs struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (l *Logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// Records returns every line as a JSON object; a line that is not one is
// returned as {"unstructured": line}.
func (l *Logs) Records() []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(l.b.String(), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil {
			rec = map[string]any{"unstructured": line}
		}
		out = append(out, rec)
	}
	return out
}

// Lines returns the records whose msg is msg.
func (l *Logs) Lines(msg string) []map[string]any {
	var out []map[string]any
	for _, rec := range l.Records() {
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}

// String returns everything written so far.
func (l *Logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
