package workload

import (
	"bytes"
	_ "embed"
	"fmt"
	"strings"
)

// conversationTrace is the Mooncake FAST'25 conversation trace, gzipped
// (provenance in traces/README.md).
//
//go:embed traces/conversation_trace.jsonl.gz
var conversationTrace []byte

// builtinPrefix marks a trace path that names a trace compiled into the
// package rather than a file.
const builtinPrefix = "builtin:"

// DefaultTracePath names the bundled Mooncake conversation trace; OpenTrace
// reads it from the binary, so kvbench works from a fresh clone.
const DefaultTracePath = builtinPrefix + "mooncake/conversation_trace.jsonl.gz"

// builtinTraces are the traces OpenTrace serves for "builtin:" paths.
var builtinTraces = map[string][]byte{DefaultTracePath: conversationTrace}

// openBuiltin reads a bundled trace; ok is false when path names none.
func openBuiltin(path string) (recs []TraceRecord, ok bool, err error) {
	if !strings.HasPrefix(path, builtinPrefix) {
		return nil, false, nil
	}
	b, found := builtinTraces[path]
	if !found {
		return nil, true, fmt.Errorf("workload: trace: no bundled trace %q (have %q)", path, DefaultTracePath)
	}
	recs, err = ReadTrace(bytes.NewReader(b))
	return recs, true, err
}
