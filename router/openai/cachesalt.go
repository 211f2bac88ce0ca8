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
	spans, err := topMembers(body)
	if err != nil {
		return nil, err
	}
	found := false
	for _, m := range spans {
		found = found || m.key == "cache_salt"
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
	for _, m := range spans {
		if m.key == "cache_salt" {
			continue
		}
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
	if mentionsCacheSalt(body[i:]) || bytes.Contains(body[i:], []byte(`\u`)) {
		return "", false // a duplicate (last one wins) or an escaped key: decode
	}
	return string(body[len(head):i]), true
}

// mentionsCacheSalt reports whether b may hold a key that encoding/json
// matches to cache_salt: it matches keys case-insensitively (the last
// match wins), by Unicode simple folding, under which the long s (U+017F)
// is an s too. Found by FuzzLeadingCacheSalt: {"cache_salt":"00",
// "CAChE_sAlt":"0"} is salt "0" to encoding/json. Searched from each '_'
// (no case), so a body without one costs one IndexByte scan.
func mentionsCacheSalt(b []byte) bool {
	const key = "cache_salt"
	if bytes.Contains(b, []byte("ſ")) { // escaped (\u017f), the caller declines it already
		return true
	}
	for i := 0; ; {
		j := bytes.IndexByte(b[i:], '_')
		if j < 0 {
			return false
		}
		k := i + j // the '_' of a candidate at b[k-5 : k+5]
		if k >= 5 && k+5 <= len(b) && bytes.EqualFold(b[k-5:k+5], []byte(key)) {
			return true
		}
		i = k + 1
	}
}

func isSaltByte(c byte) bool {
	return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}
