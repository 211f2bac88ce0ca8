package tokenizer

import "strings"

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
	_ ChatTokenizer  = Simple{}
	_ SpecialEncoder = Simple{}
)

// EncodeSpecial is Encode: the simulator adds no special tokens to any prompt.
func (s Simple) EncodeSpecial(text string) ([]uint32, error) { return s.Encode(text) }

// Byte classes of simplePattern. Every character the pattern can match is ASCII, so a
// byte scan is exact for UTF-8 (lead and continuation bytes never match, as a rune
// outside the pattern never does) and for invalid bytes (U+FFFD to RE2, matching nothing).
const (
	simplePunct = 1 << iota // one of the single-character alternatives
	simpleWord              // \w: [0-9A-Za-z_]
	simpleSpace             // \s in RE2: [\t\n\f\r ]
)

var simpleClass = func() (t [256]uint8) {
	for _, c := range []byte(`{}:,-.?!;@#$%^&*()+_~/\><[]="'`) {
		t[c] |= simplePunct
	}
	for c := 0; c < 256; c++ {
		if c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') {
			t[c] |= simpleWord
		}
	}
	for _, c := range []byte("\t\n\f\r ") {
		t[c] |= simpleSpace
	}
	return t
}()

// Encode implements Tokenizer. It never fails. It scans by hand what
// regexp.FindAllStringIndex(simplePattern) finds (FuzzSimpleEncode proves it), about 20
// times faster: Simple tokenizes every request of a simulated fleet.
func (Simple) Encode(text string) ([]uint32, error) {
	ids := make([]uint32, 0, len(text)/5+1)
	for i := 0; i < len(text); {
		start := i
		switch cls := simpleClass[text[i]]; {
		case cls&simplePunct != 0:
			// Leftmost-first alternation: "_" matches alone as a punctuation alternative
			// before \w+ is tried.
			i++
		case cls&simpleWord != 0:
			for i < len(text) && simpleClass[text[i]]&simpleWord != 0 {
				i++
			}
		default:
			i++
			continue
		}
		for i < len(text) && simpleClass[text[i]]&simpleSpace != 0 {
			i++
		}
		ids = append(ids, fnv32a(text[start:i]))
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
