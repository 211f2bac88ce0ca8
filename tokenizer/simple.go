package tokenizer

import (
	"encoding/json"
	"strings"
)

// simplePattern is the dummy tokenizer's split regex, verbatim from
// events/testdata/captured/DATA.md ("Caveats → Tokenizer"), which documents
// llm-d/llm-d-inference-sim (commit eec055a39e6b) run with --force-dummy-tokenizer.
// Group 1 is the piece, group 2 the whitespace that the piece keeps.
const simplePattern = `(\{|\}|:|,|-|\.|\?|\!|;|@|#|\$|%|\^|&|\*|\(|\)|\+|\-|_|~|/|\\|>|<|\[|\]|=|"|'|\w+)(\s*)`

// Simple is the dummy tokenizer of llm-d-inference-sim (source: the capture notes in
// events/testdata/captured/DATA.md, "Caveats → Tokenizer"): text is split with
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

// Render implements ChatTemplate the way llm-d-inference-sim renders a chat for its dummy
// tokenizer (source: llm-d/llm-d-inference-sim at eec055a39e6b, the commit the captures
// were made with: pkg/tokenizer/tokenizer.go SimpleTokenizer.RenderMessages and
// pkg/api/response.go Message.PlainText), per message:
//
//	"### " + role [+ "(" + tool_call_id + ")"] + ": " + content + "[name(arguments)]"... + "\n"
//
// content is the string content, or the list's text parts and "image: " + the URL of each
// image_url part, joined with "\n"; each tool call with a function name adds "[" + name +
// "(" + arguments + ")]", arguments as the client sent the JSON string. Without the tool call
// id and the calls, a tool-calling chat is keyed short of what the engine caches. The
// simulator has no generation prompt, tools list or template variables, so opts is ignored.
func (Simple) Render(msgs []Message, _ RenderOptions) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("### ")
		b.WriteString(m.Role)
		if m.ToolCallID != "" {
			b.WriteString("(")
			b.WriteString(m.ToolCallID)
			b.WriteString(")")
		}
		b.WriteString(": ")
		simpleContent(&b, m)
		for _, tc := range m.ToolCalls {
			if tc.Function.Name == "" {
				continue // the simulator skips calls without a name (a null one)
			}
			b.WriteString("[")
			b.WriteString(tc.Function.Name)
			b.WriteString("(")
			b.WriteString(simpleArguments(tc.Function.Arguments))
			b.WriteString(")]")
		}
		b.WriteString("\n")
	}
	return b.String(), nil
}

// simpleContent writes a message's content as the simulator flattens it: the string, or
// the text and image_url parts of a list, one per line (other parts are left out).
func simpleContent(b *strings.Builder, m Message) {
	if m.Parts == nil {
		b.WriteString(m.Content)
		return
	}
	first := true
	line := func(s string) {
		if !first {
			b.WriteString("\n")
		}
		first = false
		b.WriteString(s)
	}
	for _, p := range m.Parts {
		switch p.Type {
		case "text":
			line(p.Text)
		case "image_url":
			if iu, ok := p.Raw["image_url"].(map[string]any); ok {
				u, _ := iu["url"].(string)
				line("image: " + u)
			}
		}
	}
}

// simpleArguments is a tool call's arguments as the simulator holds them: the JSON string's
// value (the OpenAI form); any other JSON as sent.
func simpleArguments(raw json.RawMessage) string {
	var s string
	if len(raw) > 0 && raw[0] == '"' && json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
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
