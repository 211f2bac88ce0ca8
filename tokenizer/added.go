package tokenizer

import (
	"sort"
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of tokenizer.json "added_tokens": matched in the text before any
// model processing, as one id.
type addedToken struct {
	content    string
	id         uint32
	special    bool
	lstrip     bool // absorbs whitespace on its left
	rstrip     bool // absorbs whitespace on its right
	singleWord bool // matches only when not inside a word
	normalized bool // matched against normalized text rather than the raw input
}

// addedVocab finds added tokens in text, leftmost first and longest first at a position
// (Hugging Face uses a leftmost-longest Aho-Corasick automaton; with a few hundred tokens
// that share a handful of first bytes, a first-byte index does the same job).
type addedVocab struct {
	toks    []addedToken
	byFirst [256][]int32 // indices into toks, longest content first
}

func newAddedVocab(toks []addedToken) *addedVocab {
	a := &addedVocab{}
	for _, t := range toks {
		if t.content != "" {
			a.toks = append(a.toks, t)
		}
	}
	for i, t := range a.toks {
		b := t.content[0]
		a.byFirst[b] = append(a.byFirst[b], int32(i))
	}
	for b := range a.byFirst {
		l := a.byFirst[b]
		sort.SliceStable(l, func(i, j int) bool { return len(a.toks[l[i]].content) > len(a.toks[l[j]].content) })
	}
	return a
}

func (a *addedVocab) empty() bool { return a == nil || len(a.toks) == 0 }

// split calls onText for each stretch of text between added tokens (with its byte offset
// in s) and onToken for each token, in order.
func (a *addedVocab) split(s string, onText func(seg string, off int), onToken func(id uint32)) {
	if a.empty() {
		if s != "" {
			onText(s, 0)
		}
		return
	}
	last := 0
	for i := 0; i < len(s); i++ {
		cands := a.byFirst[s[i]]
		if len(cands) == 0 {
			continue
		}
		for _, ci := range cands {
			t := &a.toks[ci]
			end := i + len(t.content)
			if end > len(s) || s[i:end] != t.content {
				continue
			}
			if t.singleWord && (isWordBefore(s, i) || isWordAfter(s, end)) {
				continue
			}
			start := i
			if t.lstrip {
				for start > last {
					r, w := utf8.DecodeLastRuneInString(s[last:start])
					if !unicode.IsSpace(r) {
						break
					}
					start -= w
				}
			}
			if t.rstrip {
				for end < len(s) {
					r, w := utf8.DecodeRuneInString(s[end:])
					if !unicode.IsSpace(r) {
						break
					}
					end += w
				}
			}
			if start > last {
				onText(s[last:start], last)
			}
			onToken(t.id)
			last = end
			i = end - 1
			break
		}
	}
	if last < len(s) {
		onText(s[last:], last)
	}
}

func isWordRune(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) }

func isWordBefore(s string, i int) bool {
	if i == 0 {
		return false
	}
	r, _ := utf8.DecodeLastRuneInString(s[:i])
	return isWordRune(r)
}

func isWordAfter(s string, i int) bool {
	if i >= len(s) {
		return false
	}
	r, _ := utf8.DecodeRuneInString(s[i:])
	return isWordRune(r)
}
