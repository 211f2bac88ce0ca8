package openai

import (
	"bytes"
	"encoding/json"
	"errors"
)

// scanCacheSalt reads the top-level "cache_salt" string of a JSON object
// body (the last one when repeated, as Python's json keeps), with exact key
// match: "" when there is none, it is not a string, or body is not an object.
func CacheSalt(body []byte) string {
	salt, _ := RawString(TopLevelRaw(body, "cache_salt"))
	return salt
}

// errNotObject: the body is not one JSON object.
var errNotObject = errors.New("not a JSON object")

// InjectCacheSalt returns a copy of the JSON object body with the top-level
// member "cache_salt" set to salt. An existing cache_salt member is replaced when
// overwrite is true (every copy of it: parsers differ on which duplicate
// wins), else the body is returned as is. Other members keep their bytes
// and order; whitespace between top-level members is dropped.
func InjectCacheSalt(body []byte, salt string, overwrite bool) ([]byte, error) {
	s := &jscan{b: body}
	if s.peek() != '{' {
		return nil, errNotObject
	}
	type span struct{ start, end int }
	var keep []span // members other than cache_salt
	found := false
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
			if unquote(raw, esc) == "cache_salt" {
				found = true
			} else {
				keep = append(keep, span{start, s.i})
			}
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
	if found && !overwrite {
		return body, nil
	}
	q, err := json.Marshal(salt)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(body)+len(q)+16)
	out = append(out, `{"cache_salt":`...)
	out = append(out, q...)
	for _, m := range keep {
		out = append(out, ',')
		out = append(out, body[m.start:m.end]...)
	}
	return append(out, '}'), nil
}

// leadingCacheSalt reads the salt InjectCacheSalt wrote: a body that opens
// with {"cache_salt":"<base64url>" and mentions no other "cache_salt". It
// spares kv_aware a full JSON decode of long bodies (650 µs at 256 KiB);
// ok is false for any other shape, which then takes the general path.
func LeadingCacheSalt(body []byte) (salt string, ok bool) {
	const head = `{"cache_salt":"`
	if !bytes.HasPrefix(body, []byte(head)) {
		return "", false
	}
	i := len(head)
	for i < len(body) && isSaltByte(body[i]) {
		i++
	}
	if i+1 >= len(body) || body[i] != '"' || (body[i+1] != ',' && body[i+1] != '}') {
		return "", false
	}
	if bytes.Contains(body[i:], []byte(`"cache_salt"`)) || bytes.Contains(body[i:], []byte(`\u`)) {
		return "", false // a duplicate (last one wins) or an escaped key: decode
	}
	return string(body[len(head):i]), true
}

func isSaltByte(c byte) bool {
	return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}
