package tokenizer

import (
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// Split pre-tokenizer patterns that have a hand-written scanner. They are the Split regexes
// of Llama 3 / 3.1 (digits in runs of up to three) and Qwen2 / Qwen3 (one digit per piece),
// verbatim from the tokenizer.json files in testdata. Go's regexp (RE2) cannot run them:
// `\s+(?!\S)` needs lookahead. The scanner is proven equal to dlclark/regexp2 running the
// same pattern by the reference vectors and by FuzzGPTScanner.
const (
	llama3SplitPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwen2SplitPattern  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// gpt2Pattern is what a ByteLevel pre-tokenizer with use_regex=true applies (GPT-2,
	// RoBERTa and derivatives); it runs on regexp2.
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// splitter cuts a text segment into pre-token pieces. emit receives each piece in order;
// pieces are substrings of text and, concatenated, may omit only what a "Removed" split
// behaviour drops.
type splitter interface {
	split(text string, emit func(piece string))
}

// gptScanner is the hand-written equivalent of llama3SplitPattern (maxDigits 3) and
// qwen2SplitPattern (maxDigits 1). Each alternative of the regex is tried in order at the
// current position, with the backtracking outcomes worked out by hand (see match).
//
// Character classes follow Unicode as Go's unicode package defines it: \p{L} is
// unicode.IsLetter, \p{N} unicode.IsNumber and \s unicode.IsSpace (Unicode White_Space,
// which is what Rust's onig and regexp2 use; JavaScript's \s differs on U+0085 and U+FEFF).
// The contraction group is ASCII case-insensitive, as the Rust and JS implementations
// treat it in practice. Invalid UTF-8 bytes are treated as U+FFFD, a symbol.
type gptScanner struct {
	maxDigits int
}

var _ splitter = gptScanner{}

func (s gptScanner) split(text string, emit func(string)) {
	for pos := 0; pos < len(text); {
		end := s.match(text, pos)
		emit(text[pos:end])
		pos = end
	}
}

// Character class bits for ASCII, precomputed so the common case is a table lookup.
const (
	clsLetter = 1 << iota
	clsNumber
	clsSpace
	clsNewline // \r or \n (also has clsSpace)
)

var asciiClass = func() (t [128]uint8) {
	for c := 0; c < 128; c++ {
		r := rune(c)
		if unicode.IsLetter(r) {
			t[c] |= clsLetter
		}
		if unicode.IsNumber(r) {
			t[c] |= clsNumber
		}
		if unicode.IsSpace(r) {
			t[c] |= clsSpace
		}
		if c == '\r' || c == '\n' {
			t[c] |= clsNewline
		}
	}
	return t
}()

// classAt decodes the rune at i and returns its class bits and width.
func classAt(text string, i int) (uint8, int) {
	c := text[i]
	if c < utf8.RuneSelf {
		return asciiClass[c], 1
	}
	r, w := utf8.DecodeRuneInString(text[i:])
	var cls uint8
	switch {
	case unicode.IsLetter(r):
		cls = clsLetter
	case unicode.IsNumber(r):
		cls = clsNumber
	case unicode.IsSpace(r):
		cls = clsSpace
	}
	return cls, w
}

// match returns the end of the piece that starts at pos (pos < len(text)); it always
// advances, because every character satisfies at least one alternative.
func (s gptScanner) match(text string, pos int) int {
	// 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if text[pos] == '\'' && pos+1 < len(text) {
		switch text[pos+1] | 0x20 { // ASCII lower-case; non-letters cannot collide below
		case 's', 't', 'm', 'd':
			return pos + 2
		case 'r', 'v', 'l':
			if pos+2 < len(text) {
				want := byte('e')
				if text[pos+1]|0x20 == 'l' {
					want = 'l'
				}
				if text[pos+2]|0x20 == want {
					return pos + 3
				}
			}
		}
	}
	cls, w := classAt(text, pos)
	// 2. [^\r\n\p{L}\p{N}]?\p{L}+ — a letter run, optionally led by one character that is
	// neither a newline, a letter nor a number. If the lead is present but no letter
	// follows, backtracking to "no lead" fails too (the lead is not a letter).
	if cls&clsLetter != 0 {
		return s.letters(text, pos+w)
	}
	if cls&(clsNewline|clsNumber) == 0 && pos+w < len(text) {
		if c2, w2 := classAt(text, pos+w); c2&clsLetter != 0 {
			return s.letters(text, pos+w+w2)
		}
	}
	// 3. \p{N}{1,maxDigits}
	if cls&clsNumber != 0 {
		end := pos + w
		for n := 1; n < s.maxDigits && end < len(text); n++ {
			c, w := classAt(text, end)
			if c&clsNumber == 0 {
				break
			}
			end += w
		}
		return end
	}
	// 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*' — a symbol run, optionally led by one space, then
	// newlines. With the space present but no symbol after it, backtracking fails (a
	// space is \s), so only these two shapes match.
	start := pos
	if text[pos] == ' ' && pos+1 < len(text) {
		if c, _ := classAt(text, pos+1); c == 0 {
			start = pos + 1
		}
	}
	if start != pos || cls == 0 {
		end := start
		for end < len(text) {
			c, w := classAt(text, end)
			if c != 0 {
				break
			}
			end += w
		}
		for end < len(text) && (text[end] == '\r' || text[end] == '\n') {
			end++
		}
		return end
	}
	// Only whitespace is left. Find the maximal whitespace run [pos, runEnd) and the end
	// of its last newline.
	runEnd, lastNL := pos, -1
	for runEnd < len(text) {
		c, w := classAt(text, runEnd)
		if c&clsSpace == 0 {
			break
		}
		if c&clsNewline != 0 {
			lastNL = runEnd + 1
		}
		runEnd += w
	}
	// 5. \s*[\r\n]+ — greedy \s* backs off to the last newline of the run.
	if lastNL > 0 {
		return lastNL
	}
	// 6. \s+(?!\S) — the whole run at the end of text, else the run minus its last
	// character, when that leaves at least one character.
	if runEnd == len(text) {
		return runEnd
	}
	_, lastW := utf8.DecodeLastRuneInString(text[pos:runEnd])
	if runEnd-lastW > pos {
		return runEnd - lastW
	}
	// 7. \s+ — a single whitespace character before a non-space.
	return runEnd
}

// letters returns the end of the letter run starting at i.
func (gptScanner) letters(text string, i int) int {
	for i < len(text) {
		c, w := classAt(text, i)
		if c&clsLetter == 0 {
			break
		}
		i += w
	}
	return i
}

// regexTimeout bounds one regexp2 match.
const regexTimeout = time.Second

// regexSplitter runs an arbitrary Split pattern on regexp2 (Perl/.NET syntax with
// lookaround, like the Oniguruma engine of Hugging Face's Rust implementation).
type regexSplitter struct {
	re *regexp2.Regexp
	// removed drops the matches (behavior "Removed"); otherwise matches and the text
	// between them are both pieces ("Isolated").
	removed bool
}

var _ splitter = (*regexSplitter)(nil)

func newRegexSplitter(pattern, behavior string, invert bool) (*regexSplitter, error) {
	if invert {
		return nil, fmt.Errorf("%w: inverted split pattern", ErrUnsupported)
	}
	re, err := regexp2.Compile(pattern, regexp2.Unicode)
	if err != nil {
		return nil, fmt.Errorf("%w: split pattern %q: %w", ErrUnsupported, pattern, err)
	}
	// Backtracking patterns can go super-linear on hostile input; bound each match so a
	// request can never hang the router (the rest of the text then becomes one piece).
	re.MatchTimeout = regexTimeout
	s := &regexSplitter{re: re}
	switch strings.ToLower(behavior) {
	case "isolated", "":
	case "removed":
		s.removed = true
	default:
		return nil, fmt.Errorf("%w: split behavior %q", ErrUnsupported, behavior)
	}
	return s, nil
}

func (s *regexSplitter) split(text string, emit func(string)) {
	// regexp2 works on runes and reports rune offsets; map them back to byte offsets.
	// []rune turns each invalid byte into one U+FFFD, which DecodeRuneInString mirrors.
	runes := make([]rune, 0, len(text))
	byteAt := make([]int, 0, len(text)+1)
	for b := 0; b < len(text); {
		r, w := utf8.DecodeRuneInString(text[b:])
		runes = append(runes, r)
		byteAt = append(byteAt, b)
		b += w
	}
	byteAt = append(byteAt, len(text))
	last := 0
	m, err := s.re.FindRunesMatch(runes)
	for err == nil && m != nil {
		start, end := byteAt[m.Index], byteAt[m.Index+m.Length]
		if gap := text[last:start]; gap != "" {
			emit(gap)
		}
		if hit := text[start:end]; !s.removed && hit != "" {
			emit(hit)
		}
		last = end
		m, err = s.re.FindNextMatch(m)
	}
	if rest := text[last:]; rest != "" {
		emit(rest)
	}
}

// sequenceSplitter applies splitters one after the other, each to the pieces of the last.
type sequenceSplitter []splitter

func (s sequenceSplitter) split(text string, emit func(string)) {
	if len(s) == 0 {
		emit(text)
		return
	}
	s[0].split(text, func(p string) { s[1:].split(p, emit) })
}

// metaspace is the SentencePiece-style pre-tokenizer: spaces become the replacement
// character (U+2581 "▁"), a replacement is prepended to the first segment (prepend_scheme
// "first") or every segment ("always"), and with split=true each piece starts at a
// replacement character.
type metaspace struct {
	replacement string
	prepend     string // "always", "first" or "never"
	split       bool
}

// apply returns the transformed text; first says whether this segment starts the input.
func (m metaspace) apply(text string, first bool) string {
	out := strings.ReplaceAll(text, " ", m.replacement)
	if m.prepend == "always" || (m.prepend == "first" && first) {
		if !strings.HasPrefix(out, m.replacement) {
			out = m.replacement + out
		}
	}
	return out
}

// pieces cuts text (already transformed by apply) before every replacement character
// except one at the very start, so each piece but possibly the first starts with it.
func (m metaspace) pieces(text string, emit func(string)) {
	if text == "" {
		return
	}
	if !m.split {
		emit(text)
		return
	}
	start := 0
	for i := 1; i < len(text); {
		j := strings.Index(text[i:], m.replacement)
		if j < 0 {
			break
		}
		cut := i + j
		emit(text[start:cut])
		start, i = cut, cut+len(m.replacement)
	}
	emit(text[start:])
}
