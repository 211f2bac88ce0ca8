package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// canonicalStd is the canonical form CanonicalPrefix is held to: the whole
// document decoded into `any` and encoded again, as router.RawRoutingText
// did before.
func canonicalStd(body []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data after JSON value")
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

func TestCanonicalPrefix(t *testing.T) {
	for _, tc := range []struct {
		body, want string
		limit      int
		ok         bool
	}{
		{`{ "b": 1, "a": {"y": [1, 2.50, "<x>"], "x": null} }`, `{"a":{"x":null,"y":[1,2.50,"<x>"]},"b":1}`, 1024, true},
		{`{ "b": 1, "a": {"y": [1, 2.50, "<x>"], "x": null} }`, `{"a":{"x":n`, 11, true},
		{`{"a":1,"a":2,"A":3}`, `{"A":3,"a":2}`, 1024, true},
		{`{"k":"\u00e9\n\u2028\u0001"}`, "{\"k\":\"é\\n\\u2028\\u0001\"}", 1024, true},
		{`[1,{"b":true,"a":[]}] `, `[1,{"a":[],"b":true}]`, 1024, true},
		{`{"a":1}]`, `{"a":1}`, 1024, true}, // encoding/json's Decoder stops there too
		{`{"a":1} {"b":2}`, "", 1024, false},
		{`{"a":NaN}`, "", 1024, false},
		{`plain text`, "", 1024, false},
		{`{"input":[{},` + strings.Repeat(`{"x":1},`, 100) + `{]}`, "", 16, false}, // invalid past the prefix: not canonical
	} {
		got, ok := CanonicalPrefix([]byte(tc.body), tc.limit)
		if ok != tc.ok || string(got) != tc.want {
			t.Errorf("%s (limit %d): %q %v, want %q %v", tc.body, tc.limit, got, ok, tc.want, tc.ok)
		}
	}
}

// TestCanonicalPrefixBudgets: a body whose canonical form would cost more
// than a few passes or a bounded list is not canonicalised.
func TestCanonicalPrefixBudgets(t *testing.T) {
	wide := `{` + strings.Repeat(`"k":0,`, canonicalMembers) + `"k":1}`
	if _, ok := CanonicalPrefix([]byte(wide), 64); ok {
		t.Error("an object of more than canonicalMembers members was canonicalised")
	}
	deep := strings.Repeat(`{"a":`, 2000) + `"` + strings.Repeat("x", 1<<20) + `"` + strings.Repeat(`}`, 2000)
	if _, ok := CanonicalPrefix([]byte(deep), 1<<20); ok {
		t.Error("2,000 nested objects around 1 MiB (each level rescanned) were canonicalised")
	}
	if got, ok := CanonicalPrefix([]byte(strings.Repeat(`{"a":`, 3)+`1`+strings.Repeat(`}`, 3)), 1024); !ok || string(got) != `{"a":{"a":{"a":1}}}` {
		t.Errorf("shallow nesting: %q %v", got, ok)
	}
}

// FuzzCanonicalPrefixMatchesStd holds CanonicalPrefix to canonicalStd: the
// same accept/reject, and the prefix of the same form.
func FuzzCanonicalPrefixMatchesStd(f *testing.F) {
	for _, s := range []string{
		`{"b":1,"a":[1,2,{"d":null,"c":"x"}]}`, ` [1, 2.50e3, "\u003c"] `, `"s"`, `{`, `1 2`, `{"a":1,"a":2}`,
		`{"\u0061":1,"a":2,"b\u0000":"\ud800\udc00\ud800"}`, "{\"x\":\"\xff\\u2029\\/\"}", `-0`, `[]`, `{}`, `[{}]`, `1]`, `{"a":1}}`,
		`{"z":{"y":{"x":[true,false,null]}},"a":"` + strings.Repeat("long ", 40) + `"}`,
	} {
		f.Add([]byte(s), uint16(300))
		f.Add([]byte(s), uint16(5))
	}
	f.Fuzz(func(t *testing.T, body []byte, lim uint16) {
		limit := int(lim)%512 + 1
		got, ok := CanonicalPrefix(body, limit)
		want, err := canonicalStd(body)
		if ok != (err == nil) { // the budgets are past any body the fuzzer makes
			t.Fatalf("%q: CanonicalPrefix ok %v, encoding/json err %v", body, ok, err)
		}
		if ok && !bytes.Equal(got, want[:min(limit, len(want))]) {
			t.Fatalf("%q (limit %d):\ngot  %q\nwant %q", body, limit, got, want[:min(limit, len(want))])
		}
	})
}
