package tokenizer

import (
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

// addedVocab finds added tokens in text, leftmost first and longest first at a position,
// as Hugging Face's leftmost-longest Aho-Corasick automaton does. A byte trie is enough:
// tokens are short, and the walk from a position stops at the first byte no token continues
// with, so ordinary text costs one table lookup per byte.
type addedVocab struct {
	toks  []addedToken
	nodes []trieNode // nodes[0] is the root
	// first marks bytes that start some token, so most bytes skip the trie entirely.
	first [256]bool
}

type trieNode struct {
	next map[byte]int32
	tok  int32 // index into toks of the token ending here, or -1
}

func newAddedVocab(toks []addedToken) *addedVocab {
	a := &addedVocab{nodes: []trieNode{{tok: -1}}}
	for _, t := range toks {
		if t.content == "" {
			continue
		}
		a.toks = append(a.toks, t)
		a.first[t.content[0]] = true
		n := int32(0)
		for i := 0; i < len(t.content); i++ {
			c := t.content[i]
			nx, ok := a.nodes[n].next[c]
			if !ok {
				if a.nodes[n].next == nil {
					a.nodes[n].next = map[byte]int32{}
				}
				nx = int32(len(a.nodes))
				a.nodes[n].next[c] = nx
				a.nodes = append(a.nodes, trieNode{tok: -1})
			}
			n = nx
		}
		if a.nodes[n].tok < 0 { // the first of duplicate contents wins
			a.nodes[n].tok = int32(len(a.toks) - 1)
		}
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
	var found [8]int32 // tokens ending along the current walk, shortest first
	for i := 0; i < len(s); i++ {
		if !a.first[s[i]] {
			continue
		}
		matches := found[:0]
		for n, j := int32(0), i; j < len(s); j++ {
			nx, ok := a.nodes[n].next[s[j]]
			if !ok {
				break
			}
			n = nx
			if a.nodes[n].tok >= 0 {
				matches = append(matches, a.nodes[n].tok)
			}
		}
		for k := len(matches) - 1; k >= 0; k-- { // longest first
			t := &a.toks[matches[k]]
			start, end := i, i+len(t.content)
			if t.singleWord && (isWordBefore(s, start) || isWordAfter(s, end)) {
				continue
			}
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
