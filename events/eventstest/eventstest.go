// Package eventstest gives tests in any package the real engine messages
// captured in events/testdata/captured (llm-d-inference-sim; see its
// DATA.md), as the engine's ZMQ payloads, and a vLLM-format publisher to
// send them on (engine.go).
package eventstest

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// Dir is the directory of the capture files: found from this source file,
// so that it is the same from every package's tests.
func Dir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "testdata", "captured")
}

// CapturedPayloads returns the msgpack payloads of the capture file name
// (e.g. "map.jsonl"), in order; a missing or empty file fails the test.
func CapturedPayloads(t testing.TB, name string) [][]byte {
	t.Helper()
	f, err := os.Open(filepath.Join(Dir(), name))
	if err != nil {
		t.Fatalf("captures: %v", err)
	}
	defer f.Close()
	var out [][]byte
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		var line struct {
			Payload string `json:"payload_b64"`
		}
		if err := json.Unmarshal(s.Bytes(), &line); err != nil {
			t.Fatal(err)
		}
		p, err := base64.StdEncoding.DecodeString(line.Payload)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	if err := s.Err(); err != nil {
		t.Fatalf("captures: %s: %v", name, err)
	}
	if len(out) == 0 {
		t.Fatalf("captures: %s is empty", name)
	}
	return out
}
