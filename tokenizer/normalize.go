package tokenizer

import (
	"strings"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// normalizer rewrites a text segment before pre-tokenization (tokenizer.json "normalizer").
type normalizer func(string) string

func unicodeNormalizer(f norm.Form) normalizer {
	return func(s string) string {
		// IsNormalString is a fast scan; most text is already NFC.
		if f.IsNormalString(s) {
			return s
		}
		return f.String(s)
	}
}

func prependNormalizer(p string) normalizer {
	return func(s string) string {
		if s == "" {
			return s
		}
		return p + s
	}
}

func replaceNormalizer(old, repl string) normalizer {
	return func(s string) string { return strings.ReplaceAll(s, old, repl) }
}

func regexReplaceNormalizer(re *regexp2.Regexp, repl string) normalizer {
	return func(s string) string {
		out, err := re.Replace(s, repl, -1, -1)
		if err != nil {
			// Only a match timeout can fail, and none is set; keep the input.
			return s
		}
		return out
	}
}

func stripNormalizer(left, right bool) normalizer {
	return func(s string) string {
		if left {
			s = strings.TrimLeftFunc(s, isWhite)
		}
		if right {
			s = strings.TrimRightFunc(s, isWhite)
		}
		return s
	}
}

func sequenceNormalizer(ns []normalizer) normalizer {
	return func(s string) string {
		for _, n := range ns {
			s = n(s)
		}
		return s
	}
}
