package tokenizer

import (
	"slices"
	"strings"
	"testing"

	"github.com/dlclark/regexp2"
)

// splitAll runs a splitter and returns its pieces.
func splitAll(s splitter, text string) []string {
	var out []string
	s.split(text, func(p string) { out = append(out, p) })
	return out
}

var scannerCases = []struct {
	text        string
	llama, qwen []string
}{
	{"", nil, nil},
	{"Hello, world!", []string{"Hello", ",", " world", "!"}, []string{"Hello", ",", " world", "!"}},
	{"I'm sure they'LL", []string{"I", "'m", " sure", " they", "'LL"}, []string{"I", "'m", " sure", " they", "'LL"}},
	{"12345", []string{"123", "45"}, []string{"1", "2", "3", "4", "5"}},
	{"a  b", []string{"a", " ", " b"}, []string{"a", " ", " b"}},
	{"x   \n\n  y", []string{"x", "   \n\n", " ", " y"}, []string{"x", "   \n\n", " ", " y"}},
	{"end   ", []string{"end", "   "}, []string{"end", "   "}},
	{"\t\tindent", []string{"\t", "\tindent"}, []string{"\t", "\tindent"}},
	{" ...\n\nok", []string{" ...\n\n", "ok"}, []string{" ...\n\n", "ok"}},
	{"\n1", []string{"\n", "1"}, []string{"\n", "1"}},
	{"'hello", []string{"'hello"}, []string{"'hello"}},
	{"中文，测试", []string{"中文", "，测试"}, []string{"中文", "，测试"}},
	{"a\u00a0b", []string{"a", "\u00a0b"}, []string{"a", "\u00a0b"}},
	{"\xff\xfeab", []string{"\xff\xfe", "ab"}, []string{"\xff\xfe", "ab"}},
}

func TestGPTScanner(t *testing.T) {
	for _, tt := range scannerCases {
		if got := splitAll(gptScanner{maxDigits: 3}, tt.text); !slices.Equal(got, tt.llama) {
			t.Errorf("llama3 split(%q) = %q, want %q", tt.text, got, tt.llama)
		}
		if got := splitAll(gptScanner{maxDigits: 1}, tt.text); !slices.Equal(got, tt.qwen) {
			t.Errorf("qwen2 split(%q) = %q, want %q", tt.text, got, tt.qwen)
		}
	}
}

// TestGPTScannerMatchesRegexp2 checks the hand-written scanner against regexp2 running
// the original patterns, on the cases above and on the reference vectors' texts.
func TestGPTScannerMatchesRegexp2(t *testing.T) {
	texts := []string{}
	for _, c := range scannerCases {
		texts = append(texts, c.text)
	}
	for _, name := range models {
		for _, v := range readJSONLines[vector](t, "testdata/"+name+"/vectors.jsonl") {
			if v.Text != nil {
				texts = append(texts, *v.Text)
			} else {
				texts = append(texts, v.Rendered)
			}
		}
	}
	for _, p := range []struct {
		pattern string
		digits  int
	}{{llama3SplitPattern, 3}, {qwen2SplitPattern, 1}} {
		// No match timeout here (newRegexSplitter sets one): a loaded CI machine must not
		// turn a slow match into a false mismatch.
		re, err := regexp2.Compile(p.pattern, regexp2.Unicode)
		if err != nil {
			t.Fatal(err)
		}
		ref := &regexSplitter{re: re}
		for _, text := range texts {
			want := splitAll(ref, text)
			if got := splitAll(gptScanner{maxDigits: p.digits}, text); !slices.Equal(got, want) {
				t.Errorf("digits %d: split(%q)\n got %q\nwant %q", p.digits, text, got, want)
			}
		}
	}
}

// FuzzGPTScanner proves the scanner equal to regexp2 on the same patterns, for any input.
// Invalid UTF-8 is included: both see one U+FFFD per invalid byte.
func FuzzGPTScanner(f *testing.F) {
	for _, c := range scannerCases {
		f.Add(c.text)
	}
	f.Add("it's 's 'S 'T 're've'LL'd 3.14159 2,000,000")
	f.Add("  \r\n\r\n  \t x\u3000\u2028y\u0085z")
	f.Add("emoji 😀👍🏽 ½ ² Ⅻ ١٢٣")
	llama, err := regexp2.Compile(llama3SplitPattern, regexp2.Unicode)
	if err != nil {
		f.Fatal(err)
	}
	qwen, err := regexp2.Compile(qwen2SplitPattern, regexp2.Unicode)
	if err != nil {
		f.Fatal(err)
	}
	refs := []*regexSplitter{{re: llama}, {re: qwen}}
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 2048 {
			return // regexp2's backtracking is super-linear on long whitespace runs
		}
		for i, digits := range []int{3, 1} {
			got := splitAll(gptScanner{maxDigits: digits}, text)
			if strings.Join(got, "") != text {
				t.Fatalf("pieces %q do not cover %q", got, text)
			}
			want := splitAll(refs[i], text)
			if !slices.Equal(got, want) {
				t.Fatalf("digits %d: split(%q)\n got %q\nwant %q", digits, text, got, want)
			}
		}
	})
}

func TestMetaspacePieces(t *testing.T) {
	tests := []struct {
		m     metaspace
		text  string
		first bool
		want  []string
	}{
		{metaspace{"▁", "always", true}, "hello world", false, []string{"▁hello", "▁world"}},
		{metaspace{"▁", "first", true}, "hello world", false, []string{"hello", "▁world"}},
		{metaspace{"▁", "first", true}, "hello world", true, []string{"▁hello", "▁world"}},
		{metaspace{"▁", "never", true}, "a  b", false, []string{"a", "▁", "▁b"}},
		{metaspace{"▁", "always", false}, "a b", false, []string{"▁a▁b"}},
		{metaspace{"▁", "always", true}, " x", false, []string{"▁x"}},
	}
	for _, tt := range tests {
		var got []string
		tt.m.pieces(tt.m.apply(tt.text, tt.first), func(p string) { got = append(got, p) })
		if !slices.Equal(got, tt.want) {
			t.Errorf("%+v %q first=%v: got %q want %q", tt.m, tt.text, tt.first, got, tt.want)
		}
	}
}
