package openai

import (
	"encoding/json"
	"fmt"
	"unicode/utf8"
)

// Member is a top-level member to set in a JSON object body; a nil Value
// removes the member.
type Member struct {
	Key   string
	Value json.RawMessage
}

// memberSpan is one top-level member's bytes ("key":value) and its key.
type memberSpan struct {
	key        string
	start, end int
}

// topMembers validates the JSON object body and returns its top-level
// members in order.
func topMembers(body []byte) ([]memberSpan, error) {
	s := &jscan{b: body}
	if s.peek() != '{' {
		return nil, errNotObject
	}
	var out []memberSpan
	s.i++
	if s.peek() == '}' {
		s.i++
	} else {
		for {
			s.ws()
			start := s.i
			raw, esc, err := s.str()
			if err != nil {
				return nil, err
			}
			if err := s.expect(':'); err != nil {
				return nil, err
			}
			if _, err := s.skip(1); err != nil {
				return nil, err
			}
			out = append(out, memberSpan{key: unquote(raw, esc), start: start, end: s.i})
			if s.peek() == ',' {
				s.i++
				continue
			}
			if err := s.expect('}'); err != nil {
				return nil, err
			}
			break
		}
	}
	if s.peek() != 0 || s.i < len(s.b) {
		return nil, s.errorf("invalid character after top-level value")
	}
	return out, nil
}

// SetMembers returns a copy of the JSON object body with each member of set
// replaced (every copy of a repeated key: parsers differ on which duplicate
// wins) or removed (nil Value). Other members keep their bytes and order;
// set members with a value follow them, in set's order; whitespace between
// top-level members is dropped. Keys must be UTF-8 and values valid JSON.
func SetMembers(body []byte, set ...Member) ([]byte, error) {
	for _, m := range set {
		if !utf8.ValidString(m.Key) {
			return nil, fmt.Errorf("member key %q is not UTF-8", m.Key)
		}
	}
	spans, err := topMembers(body)
	if err != nil {
		return nil, err
	}
	touched := func(k string) bool {
		for _, m := range set {
			if m.Key == k {
				return true
			}
		}
		return false
	}
	out := make([]byte, 0, len(body)+64)
	out = append(out, '{')
	sep := func() {
		if len(out) > 1 {
			out = append(out, ',')
		}
	}
	for _, m := range spans {
		if touched(m.key) {
			continue
		}
		sep()
		out = append(out, body[m.start:m.end]...)
	}
	for _, m := range set {
		if m.Value == nil {
			continue
		}
		k, err := json.Marshal(m.Key)
		if err != nil {
			return nil, err
		}
		sep()
		out = append(out, k...)
		out = append(out, ':')
		out = append(out, m.Value...)
	}
	return append(out, '}'), nil
}
