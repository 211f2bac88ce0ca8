package openai

import (
	"encoding/json"
	"testing"
)

func TestUnquoteMatchesStd(t *testing.T) {
	for _, s := range []string{`plain`, `tab\there`, `\u00e9\u4e2d`, `\ud83d\ude00`, `\ud800`, `\ud800\u0041`, `\udc00\ud800`, "bad\xffutf8", `\/\b\f\n\r\"\\`} {
		var want string
		if err := json.Unmarshal([]byte(`"`+s+`"`), &want); err != nil {
			t.Fatal(err)
		}
		sc := &jscan{b: []byte(`"` + s + `"`)}
		raw, esc, err := sc.str()
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		if got := unquote(raw, esc); got != want {
			t.Errorf("%q: got %q, want %q", s, got, want)
		}
	}
}
