package main

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

func TestParseTokenIDs(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []uint32
		err  string
	}{
		{"json array", `[128000, 9906, 1917]`, []uint32{128000, 9906, 1917}, ""},
		{"json array with newlines", "[\n 1,\n 2\n]\n", []uint32{1, 2}, ""},
		{"whitespace", "1 2\t3\n4\r\n", []uint32{1, 2, 3, 4}, ""},
		{"commas", "1,2, 3 ,4,", []uint32{1, 2, 3, 4}, ""},
		{"max id", "4294967295", []uint32{math.MaxUint32}, ""},
		{"too big", "4294967296", nil, `"4294967296" is not a token id`},
		{"negative", "[1, -2]", nil, `element 1: "-2" is not a token id`},
		{"float", "[1.5]", nil, `"1.5" is not a token id`},
		{"exponent", "[1e3]", nil, `"1e3" is not a token id`},
		{"word", "1 two 3", nil, `token 1: "two" is not a token id`},
		{"strings in array", `["1"]`, nil, `element 0: "\"1\"" is not a token id`},
		{"nested", `[[1]]`, nil, `element 0: "[1]" is not a token id`},
		{"object in array", `[1, {}]`, nil, `element 1: "{}" is not a token id`},
		{"trailing data", `[1] [2]`, nil, "data after the JSON array"},
		{"unterminated", `[1, 2`, nil, "not a JSON array of integers"},
		{"empty", "  \n", nil, "no token ids"},
		{"empty array", "[]", nil, "no token ids"},
		{"object", `{"token_ids": [1]}`, nil, `token 0: "{\"token_ids\":" is not a token id`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseTokenIDs([]byte(tc.in))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
		})
	}
	if _, err := parseTokenIDs(nil); !errors.Is(err, errNoTokens) {
		t.Fatalf("nil input: %v", err)
	}
}

func FuzzParseTokenIDs(f *testing.F) {
	for _, s := range []string{"[1,2,3]", "1 2 3", "1,2,,3", "[", "[1e400]", "99999999999999999999", "[-0]"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		ids, err := parseTokenIDs(in)
		if err == nil && len(ids) == 0 {
			t.Fatal("no error and no ids")
		}
		if err != nil && ids != nil {
			t.Fatal("ids with an error")
		}
	})
}

func TestLookupUsageErrors(t *testing.T) {
	tests := []struct {
		args []string
		msg  string
	}{
		{[]string{"--tokens", "-"}, "--pool is required"},
		{[]string{"--pool", "llama"}, "give exactly one of --prompt-file, --chat-file and --tokens"},
		{[]string{"--pool", "llama", "--tokens", "a", "--prompt-file", "b"}, "give exactly one of --prompt-file, --chat-file and --tokens"},
		{[]string{"--pool", "llama", "--chat-file", "a", "--prompt-file", "b"}, "give exactly one of"},
		{[]string{"--pool", "llama", "--chat-file", "/dev/null"}, "--chat-file /dev/null: want a JSON array of messages"},
		{[]string{"--pool", "llama", "--tokens", "testdata/none.txt"}, "no such file"},
		{[]string{"--pool", "llama", "--prompt-file", "/dev/null"}, "--prompt-file /dev/null is empty"},
	}
	for _, tc := range tests {
		code, out, errOut := runCLI(t, append([]string{"lookup", "--router", "http://127.0.0.1:1"}, tc.args...)...)
		if code == 0 || !strings.Contains(errOut, tc.msg) {
			t.Errorf("%v: exit %d, stderr %q, want %q\n%s", tc.args, code, errOut, tc.msg, out)
		}
	}
}

func TestChatMessages(t *testing.T) {
	for in, want := range map[string]string{
		`[{"role":"user","content":"hi"}]`:                          `[{"role":"user","content":"hi"}]`,
		` {"model":"m","messages":[{"role":"user","content":"x"}]}`: `[{"role":"user","content":"x"}]`,
	} {
		got, err := chatMessages([]byte(in))
		if err != nil || string(got) != want {
			t.Errorf("chatMessages(%s) = %s, %v; want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{``, `[]`, `{"model":"m"}`, `{"messages":{}}`, `"text"`, `[1`} {
		if got, err := chatMessages([]byte(bad)); err == nil {
			t.Errorf("chatMessages(%s) = %s, want an error", bad, got)
		}
	}
}
