package tokenizer

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
)

// stopAfter is a context that reports Canceled from its n-th Err call on:
// it ends an encoding part way through, deterministically.
type stopAfter struct {
	context.Context
	n, calls int
}

func (c *stopAfter) Done() <-chan struct{} { return make(chan struct{}) }
func (c *stopAfter) Err() error {
	if c.calls++; c.calls >= c.n {
		return context.Canceled
	}
	return nil
}

// TestEncodeContextStops: an encoding stops with the context's error, in
// the middle of one long piece (a run of newlines is a single pre-token)
// as between pieces, and what it had done is not cached: the next encoding
// of the same text is whole.
func TestEncodeContextStops(t *testing.T) {
	tok := loadModel(t, "qwen3")
	ref, err := LoadHF("testdata/qwen3", HFConfig{CacheEntries: -1, SegmentCacheBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	for name, text := range map[string]string{
		"one long piece": "a" + strings.Repeat("\n", 200_000) + "a",
		"many pieces":    strings.Repeat("word ", 50_000),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := tok.EncodeContext(&stopAfter{Context: context.Background(), n: 3}, text, false)
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("err = %v, want context.Canceled", err)
			}
			want, _ := ref.Encode(text)
			got, err := tok.EncodeContext(context.Background(), text, false)
			if err != nil || !slices.Equal(got, want) {
				t.Fatalf("after a stopped encoding: %d ids, %v; want the %d of Encode", len(got), err, len(want))
			}
			if got, _ := Local(tok).TokenizeText(context.Background(), text); !slices.Equal(got, want) {
				t.Fatal("Local TokenizeText differs from Encode")
			}
		})
	}
}
