package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/router/routertest"
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

// promptStd is the prompt reading the scan (lists.go) is held to: the
// encoding/json one it replaced, which decoded a list through a
// json.RawMessage per item.
func promptStd(b []byte) (*Prompt, error) {
	b = bytes.TrimSpace(b)
	if string(b) == "null" {
		return nil, nil
	}
	p := &Prompt{}
	if b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return nil, err
		}
		p.Texts = []string{s}
		return p, nil
	}
	if b[0] != '[' {
		return nil, errors.New("prompt: want a string, a list of strings or token ids")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(b, &items); err != nil {
		return nil, err
	}
	if len(items) == 0 {
		return nil, errors.New("prompt: empty list")
	}
	first := bytes.TrimSpace(items[0])
	switch {
	case first[0] == '"':
		p.Texts = make([]string, len(items))
		for i, it := range items {
			if err := json.Unmarshal(it, &p.Texts[i]); err != nil {
				return nil, err
			}
		}
	case first[0] == '[':
		p.Tokens = make([][]uint32, len(items))
		for i, it := range items {
			if err := json.Unmarshal(it, &p.Tokens[i]); err != nil {
				return nil, err
			}
		}
	default:
		var ids []uint32
		if err := json.Unmarshal(b, &ids); err != nil {
			return nil, err
		}
		p.Tokens = [][]uint32{ids}
	}
	return p, nil
}

// FuzzPromptMatchesStd holds the prompt scan (the token-id fast path, and
// the two-pass list reading) to encoding/json's reading (promptStd): for
// any prompt value, the same accept/reject and the same Prompt (nil and
// empty slices told apart); Prompt.UnmarshalJSON reads the same.
func FuzzPromptMatchesStd(f *testing.F) {
	for _, v := range []string{
		`[1,2,3]`, ` [ 1 , 2 ,3 ] `, "[\t0\n,\r7]", `[4294967295]`, `[4294967296]`, `[99999999999999999999]`,
		`[01]`, `[1.0]`, `[1e3]`, `[1E3]`, `[-1]`, `[-0]`, `[]`, `[1,]`, `[1 2]`, `[1`, `[1,`, `[`, `[0]`,
		`[[1],[2]]`, `["a"]`, `[1,"a"]`, `[1,null]`, `[1,[2]]`, `[1]x`, `[1]]`,
		`["a","b\u00e9"]`, `["a",null]`, `["a",1]`, `["a",["b"]]`, `[null,"a"]`, `[null]`, `[null,1]`,
		`[[],[1,2],null,[3]]`, `[[1],"a"]`, `[[1],2]`, `[[1.5]]`, `[[4294967296]]`, `[[null,1]]`, `[[[1]]]`,
		`"s"`, `null`, `5`, `{}`, `[{}]`, `[true]`, `[[true]]`,
	} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v string) {
		body := []byte(`{"model":"m","prompt":` + v + `}`)
		if !routertest.ComparableWithStd(body) {
			return
		}
		var fast Request
		ferr := Decode(body, &fast, Limits{})
		var raw struct {
			Prompt json.RawMessage `json:"prompt"`
		}
		serr := json.Unmarshal(body, &raw)
		var std *Prompt
		if serr == nil && raw.Prompt != nil {
			std, serr = promptStd(raw.Prompt)
		}
		if (ferr == nil) != (serr == nil) {
			t.Fatalf("%q: fast err %v, encoding/json err %v", v, ferr, serr)
		}
		if ferr != nil {
			return
		}
		if !reflect.DeepEqual(fast.Prompt, std) {
			t.Fatalf("%q: fast %+v, encoding/json %+v", v, fast.Prompt, std)
		}
		if std != nil {
			var p Prompt
			if err := p.UnmarshalJSON(raw.Prompt); err != nil || !reflect.DeepEqual(&p, std) {
				t.Fatalf("%q: UnmarshalJSON %+v (%v), encoding/json %+v", v, p, err, std)
			}
		}
	})
}

// TestPromptTokenIDsFastPath: a flat token-id prompt is read by the fast
// path, in one pass, to the same ids; its neighbours are declined.
func TestPromptTokenIDsFastPath(t *testing.T) {
	ids := make([]string, 3000)
	want := make([]uint32, 3000)
	for i := range ids {
		want[i] = uint32(i * 1_431_655)
		ids[i] = strconv.FormatUint(uint64(want[i]), 10)
	}
	s := &jscan{b: []byte("[" + strings.Join(ids, ", ") + "]")}
	got, ok := s.tokenIDs()
	if !ok || !reflect.DeepEqual(got, want) || s.i != len(s.b) {
		t.Fatalf("fast path: ok %v, %d ids, at %d of %d", ok, len(got), s.i, len(s.b))
	}
	for _, v := range []string{`[1.5]`, `[-1]`, `[]`, `[[1]]`, `[4294967296]`, `[01]`, `[1`} {
		s := &jscan{b: []byte(v)}
		if _, ok := s.tokenIDs(); ok || s.i != 0 {
			t.Errorf("%s: taken by the fast path (ok %v, at %d)", v, ok, s.i)
		}
	}
}

// BenchmarkDecodeTokenIDPrompt decodes a completions body whose prompt is
// 8,192 token ids, by the fast path and by the general path it replaced
// (Prompt.UnmarshalJSON: encoding/json), side by side in one run.
//
//	go test -run XXX -bench DecodeTokenIDPrompt ./router/openai/
func BenchmarkDecodeTokenIDPrompt(b *testing.B) {
	ids := make([]string, 8192)
	for i := range ids {
		ids[i] = strconv.Itoa(1000 + i*37%120000)
	}
	prompt := "[" + strings.Join(ids, ",") + "]"
	body := []byte(`{"model":"m","prompt":` + prompt + `,"max_tokens":1}`)
	b.Run("scan", func(b *testing.B) {
		report := cputime.Report(b)
		for b.Loop() {
			var r Request
			if err := Decode(body, &r, Limits{}); err != nil || len(r.Prompt.Tokens[0]) != 8192 {
				b.Fatal(err)
			}
		}
		report(b.N)
	})
	b.Run("encoding-json", func(b *testing.B) {
		report := cputime.Report(b)
		for b.Loop() {
			var p Prompt
			if err := p.UnmarshalJSON([]byte(prompt)); err != nil || len(p.Tokens[0]) != 8192 {
				b.Fatal(err)
			}
		}
		report(b.N)
	})
}

// TestPromptTokenIDsSizedByArray: the fast path reserves memory for the
// array's ids, not for the rest of the body after it.
func TestPromptTokenIDsSizedByArray(t *testing.T) {
	body := []byte(`{"model":"m","prompt":[1,2,3],"user":"` + strings.Repeat("x", 1<<20) + `"}`)
	var r Request
	if err := Decode(body, &r, Limits{}); err != nil {
		t.Fatal(err)
	}
	if ids := r.Prompt.Tokens[0]; len(ids) != 3 || cap(ids) > 8 {
		t.Fatalf("ids %v with capacity %d for a 3-id prompt in a 1 MiB body", ids, cap(ids))
	}
}
