package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf16"
	"unicode/utf8"
)

// A hand-written, single-pass reader for the few fields of an OpenAI body
// the router needs. encoding/json spends ~10 µs per KiB of prompt here
// (a validity scan, then a decoding scan, then a copy of every string);
// long prompts are the point of this router, and the routing text needs
// only the first prefix_length characters. The whole document is still
// validated (malformed JSON is a 400), but strings are only scanned, and
// unescaped when they are kept.
//
// Differences from encoding/json, on purpose: object keys match exactly
// (encoding/json folds case; vLLM's pydantic models do not, so "Model" is
// not "model" upstream either), and a repeated key replaces the earlier
// value whole. The differential fuzz test holds the rest equal.

// maxJSONDepth bounds nesting, as encoding/json does, so that a body of
// 32 MiB of '[' cannot exhaust the stack.
const maxJSONDepth = 10000

var errJSONDepth = errors.New("exceeded max depth")

type jscan struct {
	b []byte
	i int
	// lim bounds what Decode builds (limits.go); parts counts the content
	// parts of the messages value being read, against lim.ContentParts.
	lim   Limits
	parts int
}

func (s *jscan) errorf(format string, a ...any) error {
	return fmt.Errorf("offset %d: "+format, append([]any{s.i}, a...)...)
}

func (s *jscan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the next non-space byte (0 at the end) without consuming it.
func (s *jscan) peek() byte {
	s.ws()
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

func (s *jscan) expect(c byte) error {
	if s.peek() != c {
		if s.i >= len(s.b) {
			return s.errorf("unexpected end of JSON input, want %q", c)
		}
		return s.errorf("invalid character %q, want %q", s.b[s.i], c)
	}
	s.i++
	return nil
}

// plainStringByte marks the bytes a string scan passes without a second
// look: all but '"', '\\' and control characters. Read-only after start.
var plainStringByte = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// str scans a string at s.i (which holds '"') and returns its raw content
// (between the quotes) and whether it contains escapes.
func (s *jscan) str() (raw []byte, escaped bool, err error) {
	if s.peek() != '"' {
		return nil, false, s.errorf("want a string")
	}
	s.i++
	start := s.i
	b := s.b
	for i := s.i; i < len(b); {
		for i < len(b) && plainStringByte[b[i]] { // the hot loop: most bytes
			i++
		}
		if i >= len(b) {
			break
		}
		c := b[i]
		switch {
		case c == '"':
			s.i = i + 1
			return b[start:i], escaped, nil
		case c == '\\':
			escaped = true
			if i+1 >= len(b) {
				s.i = i
				return nil, false, s.errorf("unterminated string escape")
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					s.i = i
					return nil, false, s.errorf("invalid \\u escape")
				}
				i += 6
			default:
				s.i = i
				return nil, false, s.errorf("invalid escape %q", b[i+1])
			}
		case c < 0x20:
			s.i = i
			return nil, false, s.errorf("control character %#x in string", c)
		default:
			i++
		}
	}
	s.i = len(b)
	return nil, false, s.errorf("unterminated string")
}

// unquote turns validated raw string content into its value, exactly as
// encoding/json does: escapes decoded, lone surrogates and invalid UTF-8
// replaced by U+FFFD.
func unquote(raw []byte, escaped bool) string {
	if !escaped && utf8.Valid(raw) {
		return string(raw)
	}
	out := make([]byte, 0, len(raw)+8)
	for i := 0; i < len(raw); {
		c := raw[i]
		switch {
		case c == '\\':
			switch raw[i+1] {
			case 'b':
				out = append(out, '\b')
			case 'f':
				out = append(out, '\f')
			case 'n':
				out = append(out, '\n')
			case 'r':
				out = append(out, '\r')
			case 't':
				out = append(out, '\t')
			case 'u':
				r := hex4(raw[i+2:])
				i += 6
				if utf16.IsSurrogate(r) {
					if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
						if d := utf16.DecodeRune(r, hex4(raw[i+2:])); d != utf8.RuneError {
							out = utf8.AppendRune(out, d)
							i += 6
							continue
						}
					}
					r = utf8.RuneError
				}
				out = utf8.AppendRune(out, r)
				continue
			default: // '"', '\\', '/'
				out = append(out, raw[i+1])
			}
			i += 2
		case c < utf8.RuneSelf:
			out = append(out, c)
			i++
		default:
			r, size := utf8.DecodeRune(raw[i:])
			if r == utf8.RuneError && size == 1 {
				out = utf8.AppendRune(out, utf8.RuneError)
			} else {
				out = append(out, raw[i:i+size]...)
			}
			i += size
		}
	}
	return string(out)
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c = c - 'a' + 10
		default:
			c = c - 'A' + 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// num scans a number per the JSON grammar.
func (s *jscan) num() error {
	b, i := s.b, s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		s.i = i
		return s.errorf("invalid number")
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.i = i
			return s.errorf("invalid number: digit expected after '.'")
		}
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.i = i
			return s.errorf("invalid number: digit expected in exponent")
		}
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	}
	s.i = i
	return nil
}

// tokenIDs reads a flat array of token ids at s.i ('[' next) in one pass:
// only plain decimal integers that fit a uint32. Anything else (a float,
// an exponent, a sign, a nested array, strings, malformed JSON, an empty
// list) leaves s.i where it was and returns ok false, so that the general
// path decides, with encoding/json's errors. Long token-id prompts are
// what kv_aware routes on; through encoding/json (a RawMessage per item,
// then []uint32) they cost ~2 µs per 100 ids.
func (s *jscan) tokenIDs() (ids []uint32, ok bool) {
	if s.peek() != '[' {
		return nil, false
	}
	// A flat array ends at its first ']': size the ids from the array, not
	// from the rest of the body (a short prompt before megabytes of other
	// fields must not reserve memory for them), and decline at once what
	// has no end or nests.
	rest := s.b[s.i+1:]
	end := bytes.IndexByte(rest, ']')
	if end < 0 || bytes.IndexByte(rest[:end], '[') >= 0 {
		return nil, false
	}
	el := &jscan{b: rest[:end]} // the elements, scanned with the same whitespace rule
	n := bytes.Count(el.b, []byte{','}) + 1
	if over(n, s.lim.TokenIDs) {
		return nil, false // the general path counts them exactly and refuses
	}
	ids = make([]uint32, 0, n)
	for {
		el.ws()
		b, i := el.b, el.i
		if i >= len(b) || b[i] < '0' || b[i] > '9' || (b[i] == '0' && i+1 < len(b) && b[i+1] >= '0' && b[i+1] <= '9') {
			return nil, false
		}
		var v uint64
		for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
			if v = v*10 + uint64(b[i]-'0'); v > 1<<32-1 {
				return nil, false
			}
		}
		ids = append(ids, uint32(v))
		el.i = i
		el.ws()
		switch {
		case el.i == len(el.b): // the closing ']'
			s.i += 1 + end + 1
			return ids, true
		case el.b[el.i] == ',':
			el.i++
		default:
			return nil, false // '.', 'e', garbage: the general path says why
		}
	}
}

func (s *jscan) lit(word string) error {
	if len(s.b)-s.i < len(word) || string(s.b[s.i:s.i+len(word)]) != word {
		return s.errorf("invalid literal, want %s", word)
	}
	s.i += len(word)
	return nil
}

// skip validates and passes over one value, returning its bytes.
func (s *jscan) skip(depth int) ([]byte, error) {
	if depth > maxJSONDepth {
		return nil, errJSONDepth
	}
	c := s.peek()
	start := s.i
	var err error
	switch {
	case c == '"':
		_, _, err = s.str()
	case c == '{':
		s.i++
		if s.peek() == '}' {
			s.i++
			break
		}
		for {
			if _, _, err = s.str(); err != nil {
				break
			}
			if err = s.expect(':'); err != nil {
				break
			}
			if _, err = s.skip(depth + 1); err != nil {
				break
			}
			if s.peek() == ',' {
				s.i++
				continue
			}
			err = s.expect('}')
			break
		}
	case c == '[':
		s.i++
		if s.peek() == ']' {
			s.i++
			break
		}
		for {
			if _, err = s.skip(depth + 1); err != nil {
				break
			}
			if s.peek() == ',' {
				s.i++
				continue
			}
			err = s.expect(']')
			break
		}
	case c == '-' || c >= '0' && c <= '9':
		err = s.num()
	case c == 't':
		err = s.lit("true")
	case c == 'f':
		err = s.lit("false")
	case c == 'n':
		err = s.lit("null")
	case c == 0 && s.i >= len(s.b):
		err = s.errorf("unexpected end of JSON input")
	default:
		err = s.errorf("invalid character %q looking for beginning of value", c)
	}
	if err != nil {
		return nil, err
	}
	return s.b[start:s.i], nil
}

// object iterates the members of an object at s.i, calling member with the
// decoded key; member must consume the value.
func (s *jscan) object(depth int, member func(key string) error) error {
	return s.container(depth, '{', '}', func() error {
		raw, esc, err := s.str()
		if err != nil {
			return err
		}
		if err := s.expect(':'); err != nil {
			return err
		}
		return member(unquote(raw, esc))
	})
}

// array iterates the elements of an array at s.i; elem must consume each.
func (s *jscan) array(depth int, elem func() error) error {
	return s.container(depth, '[', ']', elem)
}

// container walks an object or array at s.i from opener to closer, calling
// elem for each comma-separated item; elem must consume it.
func (s *jscan) container(depth int, opener, closer byte, elem func() error) error {
	if depth > maxJSONDepth {
		return errJSONDepth
	}
	if err := s.expect(opener); err != nil {
		return err
	}
	if s.peek() == closer {
		s.i++
		return nil
	}
	for {
		if err := elem(); err != nil {
			return err
		}
		if s.peek() == ',' {
			s.i++
			continue
		}
		return s.expect(closer)
	}
}

// stringOrNull reads a string into *dst; null leaves *dst unchanged (as
// encoding/json does for a string field).
func (s *jscan) stringOrNull(field string, dst *string) error {
	switch s.peek() {
	case '"':
		raw, esc, err := s.str()
		if err != nil {
			return err
		}
		*dst = unquote(raw, esc)
		return nil
	case 'n':
		return s.lit("null")
	}
	if _, err := s.skip(1); err != nil {
		return err
	}
	return fmt.Errorf("%s: want a string", field)
}

// Decode fills r from body (see the file comment), within lim: a body
// over a limit fails with a *LimitError as soon as the scan has counted
// what the message needs, before what lies beyond the limit is built.
func Decode(body []byte, r *Request, lim Limits) error {
	s := &jscan{b: body, lim: lim}
	switch s.peek() {
	case 'n': // null: an empty request, as encoding/json has it
		if err := s.lit("null"); err != nil {
			return err
		}
	case '{':
		if err := s.object(1, func(key string) error { return s.topMember(key, r) }); err != nil {
			return err
		}
	default:
		if _, err := s.skip(0); err != nil {
			return err
		}
		return errors.New("want a JSON object")
	}
	if s.peek() != 0 || s.i < len(s.b) {
		return s.errorf("invalid character %q after top-level value", s.b[s.i])
	}
	return nil
}

func (s *jscan) topMember(key string, r *Request) error {
	switch key {
	case "model":
		return s.stringOrNull("model", &r.Model)
	case "prompt_cache_key":
		return s.stringOrNull("prompt_cache_key", &r.PromptCacheKey)
	case "stream":
		switch s.peek() {
		case 't':
			r.Stream = true
			return s.lit("true")
		case 'f':
			r.Stream = false
			return s.lit("false")
		case 'n':
			return s.lit("null")
		}
		if _, err := s.skip(1); err != nil {
			return err
		}
		return errors.New("stream: want a boolean")
	case "messages":
		if s.peek() == 'n' {
			r.Messages = nil
			return s.lit("null")
		}
		if s.peek() != '[' {
			if _, err := s.skip(1); err != nil {
				return err
			}
			return errors.New("messages: want an array")
		}
		return s.messages(r)
	case "prompt":
		p, err := s.prompt(1)
		if err != nil {
			return err
		}
		r.Prompt = p
		return nil
	case "cache_salt":
		return s.raw(1, &r.CacheSalt)
	case "vllm_xargs":
		return s.raw(1, &r.VLLMXargs)
	case "add_generation_prompt":
		return s.raw(1, &r.AddGenerationPrompt)
	case "continue_final_message":
		return s.raw(1, &r.ContinueFinalMessage)
	case "add_special_tokens":
		return s.raw(1, &r.AddSpecialTokens)
	case "tools":
		return s.raw(1, &r.Tools)
	case "documents":
		return s.raw(1, &r.Documents)
	case "chat_template_kwargs":
		return s.raw(1, &r.ChatTemplateKwargs)
	case "priority":
		return s.raw(1, &r.Priority)
	case "max_tokens":
		return s.raw(1, &r.MaxTokens)
	case "max_completion_tokens":
		return s.raw(1, &r.MaxCompletionTokens)
	case "n":
		return s.raw(1, &r.N)
	case "best_of":
		return s.raw(1, &r.BestOf)
	case "kv_transfer_params":
		return s.raw(1, &r.KVTransferParams)
	case "truncate_prompt_tokens":
		return s.raw(1, &r.TruncatePromptTokens)
	case "truncation_side":
		return s.raw(1, &r.TruncationSide)
	}
	_, err := s.skip(1)
	return err
}

// The lists of an OpenAI body (messages, content parts, a prompt given as
// a list), read in place within Limits (limits.go): each item is built
// where it lies in its slice, or not at all past a limit, so that what a
// body costs to parse is bounded by the limits rather than by its size.

// over reports whether n passes the bound max (0: none).
func over(n, max int) bool { return max > 0 && n > max }

// messages reads the array at s.i ('[' next) into r.Messages. Each message
// is filled in its slot of the slice (nothing per message escapes), the
// slice of an earlier "messages" member is reused, and past lim.Messages
// the rest are only counted, for the message of the 400.
func (s *jscan) messages(r *Request) error {
	if r.Messages == nil {
		r.Messages = []ChatMessage{} // [] is an empty list, not null
	}
	r.Messages = r.Messages[:0]
	s.parts = 0
	n := 0
	err := s.array(2, func() error {
		n++
		if over(n, s.lim.Messages) {
			_, err := s.skip(3)
			return err
		}
		switch s.peek() {
		case 'n':
			r.Messages = append(r.Messages, ChatMessage{})
			return s.lit("null")
		case '{':
			r.Messages = append(r.Messages, ChatMessage{})
			m := &r.Messages[len(r.Messages)-1]
			return s.object(3, func(k string) error { return s.messageMember(k, m) })
		}
		if _, err := s.skip(3); err != nil {
			return err
		}
		return fmt.Errorf("messages[%d]: want an object", n-1)
	})
	if err == nil && over(n, s.lim.Messages) {
		err = &LimitError{Field: "messages", What: "messages", N: n, Max: s.lim.Messages}
	}
	return err
}

// contentParts passes over a message's content value at s.i, counting the
// parts of an array against lim.ContentParts (all messages together), and
// returns its bytes.
func (s *jscan) contentParts() ([]byte, error) {
	if s.peek() != '[' {
		return s.skip(3)
	}
	start := s.i
	err := s.array(3, func() error {
		if s.parts++; over(s.parts, s.lim.ContentParts) {
			return &LimitError{Field: "messages", What: "content parts", N: s.parts, Max: s.lim.ContentParts, AtLeast: true}
		}
		_, err := s.skip(4)
		return err
	})
	if err != nil {
		return nil, err
	}
	return s.b[start:s.i], nil
}

// prompt reads a completions prompt at s.i: null (nil), a string, token
// ids, or a list of strings or of token-id lists.
func (s *jscan) prompt(depth int) (*Prompt, error) {
	switch s.peek() {
	case 'n':
		return nil, s.lit("null")
	case '"': // the common long case: no second pass
		raw, esc, err := s.str()
		if err != nil {
			return nil, err
		}
		return &Prompt{Texts: []string{unquote(raw, esc)}}, nil
	case '[':
		if ids, ok := s.tokenIDs(); ok { // the common token-id case: no second pass
			return &Prompt{Tokens: [][]uint32{ids}}, nil
		}
		return s.promptList(depth)
	}
	if _, err := s.skip(depth); err != nil {
		return nil, err
	}
	return nil, errPromptShape
}

var errPromptShape = errors.New("prompt: want a string, a list of strings or token ids")

// promptList reads a prompt given as a list at s.i ('[' next), as
// encoding/json reads it into the shape its first item names: strings (a
// null item is ""), token-id lists (a null list is nil) or token ids (a
// null id is 0). A first pass validates the list and counts its prompts
// and ids, so that the limits are checked before anything is built and
// the second builds every slice at its size (all the lists' ids share one
// array).
func (s *jscan) promptList(depth int) (*Prompt, error) {
	start := s.i
	var first byte
	items, ids := 0, 0
	err := s.array(depth, func() error {
		c := s.peek()
		if items == 0 {
			first = c
		}
		items++
		switch {
		case first == '[' && c == '[':
			return s.array(depth+1, func() error {
				ids++
				_, err := s.skip(depth + 2)
				return err
			})
		case first != '"' && first != '[':
			ids++
		}
		_, err := s.skip(depth + 1)
		return err
	})
	if err != nil {
		return nil, err
	}
	end := s.i
	switch {
	case items == 0:
		return nil, errors.New("prompt: empty list")
	case (first == '"' || first == '[') && over(items, s.lim.Prompts):
		return nil, &LimitError{Field: "prompt", What: "prompts", N: items, Max: s.lim.Prompts}
	case over(ids, s.lim.TokenIDs):
		return nil, &LimitError{Field: "prompt", What: "token ids", N: ids, Max: s.lim.TokenIDs}
	}

	s.i = start
	p := &Prompt{}
	i := 0
	switch first {
	case '"':
		p.Texts = make([]string, items)
		err = s.array(depth, func() error {
			switch s.peek() {
			case '"':
				raw, esc, err := s.str()
				if err != nil {
					return err
				}
				p.Texts[i] = unquote(raw, esc)
			case 'n':
				_ = s.lit("null")
			default:
				return fmt.Errorf("prompt[%d]: want a string", i)
			}
			i++
			return nil
		})
	case '[':
		p.Tokens = make([][]uint32, items)
		all, k := make([]uint32, ids), 0
		err = s.array(depth, func() error {
			switch s.peek() {
			case '[':
				from := k
				err := s.array(depth+1, func() error {
					v, err := s.tokenID(i)
					all[k] = v
					k++
					return err
				})
				if err != nil {
					return err
				}
				p.Tokens[i] = all[from:k:k]
			case 'n':
				_ = s.lit("null")
			default:
				return fmt.Errorf("prompt[%d]: want token ids (0..4294967295)", i)
			}
			i++
			return nil
		})
	default:
		flat := make([]uint32, items)
		err = s.array(depth, func() error {
			v, err := s.tokenID(-1)
			flat[i] = v
			i++
			return err
		})
		p.Tokens = [][]uint32{flat}
	}
	if err != nil {
		return nil, err
	}
	s.i = end
	return p, nil
}

// tokenID reads one token id of prompt item (-1: of a flat list) at s.i,
// which the first pass validated: a plain decimal integer within uint32,
// or null (0: encoding/json leaves a null element as it is).
func (s *jscan) tokenID(item int) (uint32, error) {
	if s.peek() == 'n' {
		return 0, s.lit("null")
	}
	start := s.i
	var v uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		if v = v*10 + uint64(s.b[s.i]-'0'); v > 1<<32-1 {
			break
		}
		s.i++
	}
	if s.i > start && (s.i == len(s.b) || !isNumByte(s.b[s.i])) {
		return uint32(v), nil
	}
	s.i = start
	lit, _ := s.skip(1)
	if item < 0 {
		return 0, fmt.Errorf("prompt: want token ids (0..4294967295), not %.20s", lit)
	}
	return 0, fmt.Errorf("prompt[%d]: want token ids (0..4294967295), not %.20s", item, lit)
}

// isNumByte reports whether c can continue a JSON number.
func isNumByte(c byte) bool {
	return c >= '0' && c <= '9' || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'
}

// raw keeps the bytes of one value (a sub-slice of the body: no copy).
func (s *jscan) raw(depth int, dst *json.RawMessage) error {
	v, err := s.skip(depth)
	if err != nil {
		return err
	}
	*dst = v[:len(v):len(v)] // appends must not write into the body
	return nil
}

// rawString is the string a raw value holds ("" for null or absent), as
// encoding/json would decode it into a string; ok is false for any other
// type.
func RawString(v []byte) (string, bool) {
	if len(v) == 0 || string(v) == "null" {
		return "", true
	}
	s := &jscan{b: v}
	raw, esc, err := s.str()
	if err != nil || s.i != len(v) {
		return "", false
	}
	return unquote(raw, esc), true
}

func (s *jscan) messageMember(key string, m *ChatMessage) error {
	switch key {
	case "role":
		return s.stringOrNull("role", &m.Role)
	case "content":
		switch s.peek() {
		case '"':
			raw, esc, err := s.str()
			if err != nil {
				return err
			}
			m.Content = MessageContent{Parts: []string{unquote(raw, esc)}}
			return nil
		case 'n':
			m.Content = MessageContent{}
			return s.lit("null")
		}
		raw, err := s.contentParts()
		if err != nil {
			return err
		}
		return m.Content.UnmarshalJSON(raw) // arrays of parts: short, rare
	case "name":
		return s.raw(3, &m.Name)
	case "tool_call_id":
		return s.raw(3, &m.ToolCallID)
	case "reasoning":
		return s.raw(3, &m.Reasoning)
	case "reasoning_content":
		return s.raw(3, &m.ReasoningContent)
	case "tool_calls":
		return s.raw(3, &m.ToolCalls)
	case "tools":
		return s.raw(3, &m.Tools)
	}
	_, err := s.skip(3)
	return err
}

// TopLevel is the raw value of the top-level member key (exact match, the
// last one when repeated) of a JSON object body, nil when there is none;
// an error when body is not one strict JSON object.
func TopLevel(body []byte, key string) (json.RawMessage, error) {
	s := &jscan{b: body}
	if s.peek() != '{' {
		return nil, errNotObject
	}
	var v json.RawMessage
	err := s.object(1, func(k string) error {
		raw, err := s.skip(1)
		if err == nil && k == key {
			v = raw
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if s.peek() != 0 || s.i < len(s.b) {
		return nil, s.errorf("invalid character %q after top-level value", s.b[s.i])
	}
	return v, nil
}

// TopLevelRaw is TopLevel's value, nil as well when body is not a JSON
// object.
func TopLevelRaw(body []byte, key string) json.RawMessage {
	v, _ := TopLevel(body, key)
	return v
}
