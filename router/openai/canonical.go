package openai

import (
	"bytes"
	"slices"
	"unicode/utf8"
)

// The canonical form of a raw invocation body (a pool's canonicalize_json)
// is encoding/json's re-serialisation of the decoded document: object keys
// sorted (the last of a repeated key wins), no insignificant whitespace,
// numbers as written, strings re-encoded without HTML escaping. Routing
// needs only its first prefix_length bytes, so it is written here straight
// from the body and stops there: decoding the whole document into `any`,
// as it was, cost 50-270 bytes of heap a byte of body (a 3 MiB body of
// "{}," items: ~860 MB).
//
// To sort an object's keys its members are listed (a key and the offset
// of its value, 32 bytes each) while it is written; the rest of the body
// is only validated. Two budgets keep a hostile body from costing more than
// a few passes over it: canonicalMembers bounds the members listed at once,
// and the bytes rescanned to list nested objects may not pass
// canonicalRescan times the body (plus canonicalSlack). A body over either
// is not canonicalised: it routes by its raw bytes, as a body that is not
// JSON does.

const (
	// canonicalMembers: 16,384 members (512 KiB of list) is far beyond
	// the objects of an inference payload (a few parameters, a list of
	// messages is an array).
	canonicalMembers = 1 << 14
	// canonicalRescan: each nesting level written rescans the object it
	// opens; payloads nest a few levels, and their bulk (a prompt) sits
	// near the top. canonicalSlack spares small bodies the count.
	canonicalRescan = 4
	canonicalSlack  = 64 << 10
)

// keySpan is a member of an object being written: its decoded key and
// where its value starts.
type keySpan struct {
	key []byte
	val int
}

type canon struct {
	s      jscan
	out    []byte
	limit  int
	keys   []keySpan // the members of the objects being written, outermost first
	rescan int       // bytes left to rescan
}

// CanonicalPrefix returns the first limit bytes of body's canonical form
// (the file comment), and false when body is not one JSON document (or is
// past a budget): then it routes by its raw bytes.
func CanonicalPrefix(body []byte, limit int) ([]byte, bool) {
	c := &canon{s: jscan{b: body}, out: make([]byte, 0, min(limit, len(body)+16)), limit: limit, rescan: canonicalRescan*len(body) + canonicalSlack}
	if c.value(1) != nil {
		return nil, false
	}
	// encoding/json's Decoder took the first value and asked More(), which
	// is false at the end and before a ']' or '}'.
	if next := c.s.peek(); next != 0 && next != ']' && next != '}' || next == 0 && c.s.i < len(body) {
		return nil, false
	}
	return c.out, true
}

func (c *canon) full() bool { return len(c.out) >= c.limit }

// put appends b, cut at the limit.
func (c *canon) put(b ...byte) {
	c.out = append(c.out, b[:min(len(b), c.limit-len(c.out))]...)
}

// value writes the value at c.s.i; depth is its nesting, as encoding/json counts.
func (c *canon) value(depth int) error {
	if c.full() { // the rest is only validated
		_, err := c.s.skip(depth)
		return err
	}
	s := &c.s
	switch s.peek() {
	case '{':
		return c.object(depth)
	case '[':
		c.put('[')
		first := true
		err := s.array(depth, func() error {
			if !first {
				c.put(',')
			}
			first = false
			return c.value(depth + 1)
		})
		c.put(']')
		return err
	case '"':
		raw, esc, err := s.str()
		if err != nil {
			return err
		}
		if esc || !utf8.Valid(raw) {
			raw = []byte(unquote(raw, esc))
		}
		c.putString(raw)
		return nil
	}
	v, err := s.skip(depth) // a number, as written, or a literal
	if err == nil {
		c.put(v...)
	}
	return err
}

// object lists the members of the object at c.s.i, then writes them in key
// order, each key once (its last value).
func (c *canon) object(depth int) error {
	s := &c.s
	start, base := s.i, len(c.keys)
	defer func() { c.keys = c.keys[:base] }()
	err := s.container(depth, '{', '}', func() error {
		raw, esc, err := s.str()
		if err != nil {
			return err
		}
		if esc || !utf8.Valid(raw) {
			raw = []byte(unquote(raw, esc))
		}
		if err := s.expect(':'); err != nil {
			return err
		}
		if len(c.keys) >= canonicalMembers {
			return errCanonicalBudget
		}
		c.keys = append(c.keys, keySpan{key: raw, val: s.i})
		_, err = s.skip(depth + 1)
		return err
	})
	if err != nil {
		return err
	}
	end := s.i
	if c.rescan -= end - start; c.rescan < 0 {
		return errCanonicalBudget // the object's values are scanned again below
	}
	members := c.keys[base:]
	slices.SortStableFunc(members, func(a, b keySpan) int { return bytes.Compare(a.key, b.key) })
	c.put('{')
	wrote := false
	for i, m := range members {
		if i+1 < len(members) && bytes.Equal(m.key, members[i+1].key) {
			continue // a later value of the same key wins
		}
		if c.full() {
			break
		}
		if wrote {
			c.put(',')
		}
		wrote = true
		c.putString(m.key)
		c.put(':')
		s.i = m.val
		if err := c.value(depth + 1); err != nil {
			return err
		}
	}
	c.put('}')
	s.i = end
	return nil
}

var errCanonicalBudget = errorString("canonical form over budget")

type errorString string

func (e errorString) Error() string { return string(e) }

const hexDigits = "0123456789abcdef"

// putString writes s (valid UTF-8) as encoding/json's encoder does without
// HTML escaping, cut at the limit.
func (c *canon) putString(s []byte) {
	c.put('"')
	start := 0
	for i := 0; i < len(s) && i-start < c.limit-len(c.out); {
		b := s[i]
		if b >= utf8.RuneSelf {
			r, size := utf8.DecodeRune(s[i:])
			if r == '\u2028' || r == '\u2029' {
				c.put(s[start:i]...)
				c.put('\\', 'u', '2', '0', '2', hexDigits[r&0xF])
				start = i + size
			}
			i += size
			continue
		}
		if b >= 0x20 && b != '"' && b != '\\' {
			i++
			continue
		}
		c.put(s[start:i]...)
		switch b {
		case '\\', '"':
			c.put('\\', b)
		case '\b':
			c.put('\\', 'b')
		case '\f':
			c.put('\\', 'f')
		case '\n':
			c.put('\\', 'n')
		case '\r':
			c.put('\\', 'r')
		case '\t':
			c.put('\\', 't')
		default:
			c.put('\\', 'u', '0', '0', hexDigits[b>>4], hexDigits[b&0xF])
		}
		i++
		start = i
	}
	c.put(s[start:]...)
	c.put('"')
}
