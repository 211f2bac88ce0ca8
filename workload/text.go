package workload

import "strings"

// VocabSize is the number of distinct words (and so token ids) prompts draw from.
// 2^16 words make a run of 16 tokens (one vLLM block) collide with another
// with probability 2^-256: block keys of different segments never alias.
const VocabSize = 1 << 16

// Segment is a run of Len tokens determined by Seed. Role is the chat role
// the segment plays in Messages ("system", "user", "assistant"); it does not
// change the tokens.
type Segment struct {
	Seed uint64 `json:"seed"`
	Len  int    `json:"len"`
	Role string `json:"role,omitempty"`
}

// mix is SplitMix64's finaliser: a bijective, well-diffused 64-bit hash.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// derive makes a child seed from a parent seed and a label, so that seeds of
// different generators, groups and turns never coincide by construction.
func derive(seed uint64, label string, n uint64) uint64 {
	h := mix(seed)
	for i := 0; i < len(label); i++ {
		h = mix(h ^ uint64(label[i]))
	}
	return mix(h ^ mix(n+0x51))
}

// WordIndex returns the vocabulary index of token j of a segment with seed.
func WordIndex(seed uint64, j int) uint32 {
	return uint32(mix(seed^mix(uint64(j))) % VocabSize)
}

// appendWord writes word w ("k" followed by base-26 letters) and a space.
// Every word matches \w+ alone, so the Simple tokenizer makes it one piece.
func appendWord(dst []byte, w uint32) []byte {
	dst = append(dst, 'k')
	for {
		dst = append(dst, byte('a'+w%26))
		w /= 26
		if w == 0 {
			break
		}
	}
	return append(dst, ' ')
}

// TokenID is the id the Simple tokenizer gives word w with its trailing
// space: FNV-32a of the bytes (the dummy tokenizer's rule, see
// events/testdata/captured/DATA.md, "Caveats → Tokenizer").
func TokenID(w uint32) uint32 {
	var buf [16]byte
	b := appendWord(buf[:0], w)
	h := uint32(2166136261)
	for _, c := range b {
		h ^= uint32(c)
		h *= 16777619
	}
	return h
}

// AppendTokens appends the segment's token ids to dst.
func (s Segment) AppendTokens(dst []uint32) []uint32 {
	for j := 0; j < s.Len; j++ {
		dst = append(dst, TokenID(WordIndex(s.Seed, j)))
	}
	return dst
}

// AppendText appends the segment's text form to dst.
func (s Segment) AppendText(dst []byte) []byte {
	for j := 0; j < s.Len; j++ {
		dst = appendWord(dst, WordIndex(s.Seed, j))
	}
	return dst
}

// Text is the segment's text form.
func (s Segment) Text() string { return string(s.AppendText(nil)) }

// segmentsText joins segments' text forms.
func segmentsText(segs []Segment) string {
	var b strings.Builder
	var buf []byte
	for _, s := range segs {
		buf = s.AppendText(buf[:0])
		b.Write(buf)
	}
	return b.String()
}
