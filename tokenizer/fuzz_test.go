package tokenizer

import (
	"slices"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// FuzzEncode: no input panics or hangs; byte-level models round-trip through Decode
// (Qwen3 up to its NFC normalizer); cache on and off, and the two BPE merge loops, agree.
func FuzzEncode(f *testing.F) {
	f.Add("Hello, world! I'm here.")
	f.Add("<|begin_of_text|>x<|eot_id|><|im_start|>user\nhi<|im_end|><think>")
	f.Add("naïve café 😀👍🏽 中文 ｆｕｌｌ \u00a0\u0085\ufeff\r\n\t 12345")
	f.Add("e\u0301 A\u030a \xff\xfe")
	f.Add("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
	llama, qwen := loadModel(f, "llama-3.1"), loadModel(f, "qwen3")
	sp, err := LoadHF("testdata/sentencepiece/llama2", HFConfig{})
	if err != nil {
		f.Fatal(err)
	}
	uncached := map[*HF]*HF{}
	for _, tok := range []*HF{llama, qwen} {
		c := *tok
		c.cache, c.segs = nil, nil
		uncached[tok] = &c
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, tok := range []*HF{llama, qwen} {
			ids, err := tok.Encode(s)
			if err != nil {
				t.Fatal(err)
			}
			cold, _ := uncached[tok].Encode(s)
			if !slices.Equal(ids, cold) {
				t.Fatalf("cached %v != uncached %v for %q", ids, cold, s)
			}
			if !utf8.ValidString(s) {
				continue
			}
			back, err := tok.Decode(ids)
			if err != nil {
				t.Fatal(err)
			}
			want := s
			if tok == qwen {
				want = norm.NFC.String(s)
			}
			if back != want {
				t.Fatalf("Decode(Encode(%q)) = %q", s, back)
			}
		}
		if _, err := sp.Encode(s); err != nil {
			t.Fatal(err)
		}
	})
}

// FuzzMergeLoops: the heap merge loop used for long pieces gives the naive loop's result.
func FuzzMergeLoops(f *testing.F) {
	f.Add(" internationalization")
	f.Add("                                                                  ")
	f.Add("abababababababababababababababababababababababababababababababab")
	m := loadModel(f, "qwen3").model
	f.Fuzz(func(t *testing.T, s string) {
		if len(s) > 4096 {
			return
		}
		a := m.mergeNaive(m.initialSymbols(nil, s))
		b := m.mergeHeap(m.initialSymbols(nil, s))
		if !slices.Equal(a, b) {
			t.Fatalf("%q: naive %v heap %v", s, a, b)
		}
	})
}
