package tokenizer

import (
	"regexp"
	"strings"
)

// simplePattern is the dummy tokenizer's split regex, verbatim from
// /work/shared/kv-events/captured/DATA.md ("Caveats → Tokenizer"), which documents
// llm-d/llm-d-inference-sim (commit eec055a39e6b) run with --force-dummy-tokenizer.
// Group 1 is the piece, group 2 the whitespace that the piece keeps.
const simplePattern = `(\{|\}|:|,|-|\.|\?|\!|;|@|#|\$|%|\^|&|\*|\(|\)|\+|\-|_|~|/|\\|>|<|\[|\]|=|"|'|\w+)(\s*)`

// Simple is the dummy tokenizer of llm-d-inference-sim (source: the capture notes in
// /work/shared/kv-events/captured/DATA.md, "Caveats → Tokenizer"): text is split with
// simplePattern, each piece keeps its trailing whitespace, and a piece's id is the FNV-32a
// hash of its UTF-8 bytes; characters the pattern does not match produce no token. Chat
// prompts are flattened per message as "### " + role + ": " + content + "\n".
//
// Its ids are not vocabulary ids; it exists so that kvsim and the router agree on tokens
// (and hence block keys) when no model files are configured, and so that captures from
// the simulator can be replayed exactly. The zero value is ready to use.
type Simple struct{}

var (
	_ ChatTokenizer = Simple{}
	// simpleRE is compiled once; a *regexp.Regexp is immutable and safe for concurrent use.
	simpleRE = regexp.MustCompile(simplePattern)
)

// Encode implements Tokenizer. It never fails.
func (Simple) Encode(text string) ([]uint32, error) {
	locs := simpleRE.FindAllStringIndex(text, -1)
	ids := make([]uint32, len(locs))
	for i, l := range locs {
		ids[i] = fnv32a(text[l[0]:l[1]])
	}
	return ids, nil
}

// Render implements ChatTemplate: "### role: content\n" per message. The simulator has no
// generation prompt, tools or template variables, so opts is ignored.
func (Simple) Render(msgs []Message, _ RenderOptions) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("### ")
		b.WriteString(m.Role)
		b.WriteString(": ")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	return b.String(), nil
}

// fnv32a is FNV-1a 32-bit (as hash/fnv.New32a) over s, without converting s to []byte.
func fnv32a(s string) uint32 {
	const (
		offset32 = 2166136261
		prime32  = 16777619
	)
	h := uint32(offset32)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= prime32
	}
	return h
}
