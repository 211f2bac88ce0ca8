package tokenizer

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// Errors returned while loading model files.
var (
	// ErrUnsupported marks a tokenizer.json feature this package does not implement; the
	// message names it. Operators should then use the engine's /tokenize endpoint.
	ErrUnsupported = errors.New("tokenizer: unsupported tokenizer.json feature")
	// ErrNoChatTemplate is returned by Render when the model files carry no chat template.
	ErrNoChatTemplate = errors.New("tokenizer: model has no chat template")
	// ErrBadModelFile reports a tokenizer.json or tokenizer_config.json that cannot be read.
	ErrBadModelFile = errors.New("tokenizer: bad model file")
)

// DefaultCacheEntries is the default bound of the per-piece cache: about 64k distinct
// pre-token pieces (words with their leading space), a few MB, which covers the working
// vocabulary of a prompt corpus so hot prompts skip BPE entirely.
const DefaultCacheEntries = 1 << 16

// DefaultSegmentCacheBytes is the default bound of the segment cache: 64 MB holds the
// distinct messages of a few thousand long prompts, the working set of a prefix-heavy
// workload, at a memory cost small beside a router's block index.
const DefaultSegmentCacheBytes = 64 << 20

// minSegment is the shortest segment worth caching whole; shorter ones (role headers,
// short turns) are cheap through the piece cache.
const minSegment = 64

// HFConfig configures a tokenizer loaded from Hugging Face model files. The zero value is
// valid and means the documented defaults.
type HFConfig struct {
	// CacheEntries bounds the piece → ids cache. 0 means DefaultCacheEntries; a negative
	// value disables the cache.
	CacheEntries int
	// SegmentCacheBytes bounds the cache of whole text segments (the text between two
	// special tokens, e.g. one chat message) → ids, by key bytes plus 4 bytes per id.
	// 0 means DefaultSegmentCacheBytes; negative disables it. A repeated system prompt or
	// conversation history then costs one hash lookup per message instead of BPE per word.
	SegmentCacheBytes int
	// ChatTemplate overrides the chat template found in the model files (vLLM's
	// --chat-template). Empty means: chat_template.jinja if present, else
	// tokenizer_config.json "chat_template".
	ChatTemplate string
}

// HF is a tokenizer loaded from a model's tokenizer.json and tokenizer_config.json:
// byte-level BPE (Llama 3, Qwen2/3, GPT-2 family) or SentencePiece-style BPE (Metaspace or
// Prepend/Replace normalizers, byte fallback; Llama 2, Mistral), with added and special
// tokens, and the model's Jinja chat template. Pure Go; safe for concurrent use.
type HF struct {
	specials *addedVocab // added tokens matched on raw text (normalized: false)
	normAdd  *addedVocab // added tokens matched after normalization (normalized: true)
	norm     normalizer
	pre      []preStage
	fast     splitter // set when pre is exactly one splitter (the common case)
	model    *bpe
	cache    *pieceCache
	segs     *segmentCache // nil when disabled

	idToToken []string // vocabulary token strings by id (as in tokenizer.json)
	decoders  []decoderStep
	byteDec   map[rune]byte // ByteLevel alphabet → byte

	tmpl ChatTemplate // nil when the files have no chat template
	// toolTmpl is the template named "tool_use" of a list of named templates, which
	// requests with tools render through (transformers' get_chat_template); nil if none.
	toolTmpl ChatTemplate

	// prefix and suffix are what add_special_tokens=true puts around a single sequence
	// (the post-processor's template); postErr is set when the post-processor is not
	// understood, and only EncodeSpecial reports it.
	prefix, suffix []uint32
	postErr        error
}

var _ ChatTokenizer = (*HF)(nil)

// LoadHF loads dir/tokenizer.json (or tokenizer.json.gz) and, when present,
// dir/tokenizer_config.json and dir/chat_template.jinja.
func LoadHF(dir string, cfg HFConfig) (*HF, error) {
	tj, err := readMaybeGz(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, err
	}
	tc, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("tokenizer: read tokenizer_config.json: %w", err)
	}
	if cfg.ChatTemplate == "" {
		if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
			cfg.ChatTemplate = string(b)
		}
	}
	return NewHF(tj, tc, cfg)
}

func readMaybeGz(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		return b, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("tokenizer: read %s: %w", path, err)
	}
	f, gzErr := os.Open(path + ".gz")
	if gzErr != nil {
		return nil, fmt.Errorf("tokenizer: read %s: %w", path, err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: read %s.gz: %w", path, err)
	}
	b, err = io.ReadAll(zr)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: read %s.gz: %w", path, err)
	}
	return b, nil
}

// hfFile is the subset of tokenizer.json this package reads.
type hfFile struct {
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	Decoder       json.RawMessage `json:"decoder"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Model         struct {
		Type                    string            `json:"type"`
		Vocab                   map[string]uint32 `json:"vocab"`
		Merges                  []json.RawMessage `json:"merges"`
		UnkToken                *string           `json:"unk_token"`
		FuseUnk                 bool              `json:"fuse_unk"`
		ByteFallback            bool              `json:"byte_fallback"`
		IgnoreMerges            bool              `json:"ignore_merges"`
		ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
		Dropout                 *float64          `json:"dropout"`
	} `json:"model"`
}

// hfAddedToken is an entry of tokenizer.json "added_tokens".
type hfAddedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	Lstrip     bool   `json:"lstrip"`
	Rstrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// component is the union of the fields of normalizers, pre-tokenizers and decoders used.
type component struct {
	Type          string            `json:"type"`
	Normalizers   []json.RawMessage `json:"normalizers"`
	Pretokenizers []json.RawMessage `json:"pretokenizers"`
	Decoders      []json.RawMessage `json:"decoders"`
	Prepend       string            `json:"prepend"`
	Pattern       struct {
		String *string `json:"String"`
		Regex  *string `json:"Regex"`
	} `json:"pattern"`
	Content        string `json:"content"`
	StripLeft      bool   `json:"strip_left"`
	StripRight     bool   `json:"strip_right"`
	Behavior       string `json:"behavior"`
	Invert         bool   `json:"invert"`
	AddPrefixSpace *bool  `json:"add_prefix_space"`
	UseRegex       *bool  `json:"use_regex"`
	Replacement    string `json:"replacement"`
	PrependScheme  string `json:"prepend_scheme"`
	Split          *bool  `json:"split"`
	Start          int    `json:"start"`
	Stop           int    `json:"stop"`
}

// NewHF builds a tokenizer from the contents of tokenizer.json and tokenizer_config.json
// (configJSON may be nil: no chat template, no bos/eos).
func NewHF(tokenizerJSON, configJSON []byte, cfg HFConfig) (*HF, error) {
	var f hfFile
	if err := json.Unmarshal(tokenizerJSON, &f); err != nil {
		return nil, fmt.Errorf("%w: tokenizer.json: %w", ErrBadModelFile, err)
	}
	if f.Model.Type != "BPE" && !(f.Model.Type == "" && f.Model.Merges != nil) {
		return nil, fmt.Errorf("%w: model type %q (only BPE)", ErrUnsupported, f.Model.Type)
	}
	if p := f.Model.ContinuingSubwordPrefix; p != nil && *p != "" {
		return nil, fmt.Errorf("%w: continuing_subword_prefix %q", ErrUnsupported, *p)
	}
	if p := f.Model.EndOfWordSuffix; p != nil && *p != "" {
		return nil, fmt.Errorf("%w: end_of_word_suffix %q", ErrUnsupported, *p)
	}
	t := &HF{}
	var err error
	if t.norm, err = buildNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	byteLevel := false
	if t.pre, byteLevel, err = buildPreTokenizer(f.PreTokenizer); err != nil {
		return nil, err
	}
	if len(t.pre) == 1 {
		if s, ok := t.pre[0].(splitStage); ok {
			t.fast = s.s
		}
	}
	if t.decoders, err = buildDecoders(f.Decoder); err != nil {
		return nil, err
	}
	t.prefix, t.suffix, t.postErr = buildPostProcessor(f.PostProcessor)
	if t.model, t.idToToken, err = buildBPE(&f, byteLevel); err != nil {
		return nil, err
	}
	if byteLevel {
		t.byteDec = make(map[rune]byte, 256)
		for b, r := range byteLevelAlphabet() {
			t.byteDec[r] = byte(b)
		}
	}
	var raw, normed []addedToken
	for _, a := range f.AddedTokens {
		if int(a.ID) > maxVocabID(len(f.Model.Vocab)+len(f.AddedTokens)) {
			return nil, fmt.Errorf("%w: added token id %d is far beyond the vocabulary", ErrBadModelFile, a.ID)
		}
		tok := addedToken{content: a.Content, id: a.ID, special: a.Special, lstrip: a.Lstrip,
			rstrip: a.Rstrip, singleWord: a.SingleWord, normalized: a.Normalized && !a.Special}
		if tok.normalized && t.norm != nil {
			normed = append(normed, tok)
		} else {
			raw = append(raw, tok)
		}
		for int(a.ID) >= len(t.idToToken) {
			t.idToToken = append(t.idToToken, "")
		}
		t.idToToken[a.ID] = a.Content
	}
	t.specials, t.normAdd = newAddedVocab(raw), newAddedVocab(normed)
	switch {
	case cfg.CacheEntries == 0:
		t.cache = newPieceCache(DefaultCacheEntries)
	case cfg.CacheEntries > 0:
		t.cache = newPieceCache(cfg.CacheEntries)
	}

	switch {
	case cfg.SegmentCacheBytes == 0:
		t.segs = newSegmentCache(DefaultSegmentCacheBytes)
	case cfg.SegmentCacheBytes > 0:
		t.segs = newSegmentCache(cfg.SegmentCacheBytes)
	}

	tc, err := parseTokenizerConfig(configJSON)
	if err != nil {
		return nil, err
	}
	src := cfg.ChatTemplate
	if src == "" {
		src = tc.template
	}
	tcfg := TemplateConfig{BOSToken: tc.bos, EOSToken: tc.eos}
	if src != "" {
		if t.tmpl, err = NewJinjaTemplate(src, tcfg); err != nil {
			return nil, err
		}
	}
	if cfg.ChatTemplate == "" && tc.toolTemplate != "" {
		if t.toolTmpl, err = NewJinjaTemplate(tc.toolTemplate, tcfg); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// maxVocabID bounds ids so a corrupt file cannot make the id table allocate gigabytes:
// real vocabularies are dense, with at most a few reserved gaps.
func maxVocabID(entries int) int { return 2*entries + 1<<16 }

// byteLevelAlphabet is GPT-2's bytes_to_unicode table: printable Latin-1 bytes stand for
// themselves, the rest are shifted to U+0100 onwards, so every byte is a visible character.
func byteLevelAlphabet() [256]rune {
	var t [256]rune
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			t[b] = rune(b)
		} else {
			t[b] = rune(256 + n)
			n++
		}
	}
	return t
}

func buildBPE(f *hfFile, byteLevel bool) (*bpe, []string, error) {
	m := &bpe{
		vocab:        make(map[string]uint32, len(f.Model.Vocab)),
		merges:       make(map[uint64]uint64, len(f.Model.Merges)),
		byteLevel:    byteLevel,
		ignoreMerges: f.Model.IgnoreMerges,
		byteFallback: f.Model.ByteFallback,
		fuseUnk:      f.Model.FuseUnk,
	}
	maxID := uint32(0)
	for _, id := range f.Model.Vocab {
		maxID = max(maxID, id)
	}
	if int(maxID) > maxVocabID(len(f.Model.Vocab)) {
		return nil, nil, fmt.Errorf("%w: vocabulary id %d for %d entries", ErrBadModelFile, maxID, len(f.Model.Vocab))
	}
	idToToken := make([]string, int(maxID)+1)
	var dec map[rune]byte
	if byteLevel {
		dec = make(map[rune]byte, 256)
		for b, r := range byteLevelAlphabet() {
			dec[r] = byte(b)
		}
	}
	// key turns a vocabulary string into the bytes it stands for (byte-level models).
	key := func(tok string) (string, bool) {
		if !byteLevel {
			return tok, true
		}
		var sb strings.Builder
		for _, r := range tok {
			b, ok := dec[r]
			if !ok {
				return "", false
			}
			sb.WriteByte(b)
		}
		return sb.String(), true
	}
	for tok, id := range f.Model.Vocab {
		idToToken[id] = tok
		if k, ok := key(tok); ok {
			m.vocab[k] = id
		}
	}
	if byteLevel {
		for b := 0; b < 256; b++ {
			id, ok := m.vocab[string([]byte{byte(b)})]
			if !ok {
				return nil, nil, fmt.Errorf("%w: byte-level vocabulary lacks byte 0x%02X", ErrBadModelFile, b)
			}
			m.byteIDs[b] = id
		}
	}
	if m.byteFallback {
		for b := 0; b < 256; b++ {
			id, ok := m.vocab[fmt.Sprintf("<0x%02X>", b)]
			if !ok {
				return nil, nil, fmt.Errorf("%w: byte_fallback without token <0x%02X>", ErrBadModelFile, b)
			}
			m.byteFallIDs[b] = id
		}
	}
	if u := f.Model.UnkToken; u != nil {
		id, ok := f.Model.Vocab[*u]
		if !ok {
			return nil, nil, fmt.Errorf("%w: unk_token %q not in vocabulary", ErrBadModelFile, *u)
		}
		m.unk, m.hasUnk = id, true
	}
	for rank, raw := range f.Model.Merges {
		var a, b string
		var pair []string
		if err := json.Unmarshal(raw, &pair); err == nil && len(pair) == 2 {
			a, b = pair[0], pair[1]
		} else {
			var s string
			if err := json.Unmarshal(raw, &s); err != nil {
				return nil, nil, fmt.Errorf("%w: merge %d: %s", ErrBadModelFile, rank, raw)
			}
			var ok bool
			if a, b, ok = strings.Cut(s, " "); !ok {
				return nil, nil, fmt.Errorf("%w: merge %d %q has no space", ErrBadModelFile, rank, s)
			}
		}
		ia, okA := f.Model.Vocab[a]
		ib, okB := f.Model.Vocab[b]
		im, okM := f.Model.Vocab[a+b]
		if !okA || !okB || !okM {
			return nil, nil, fmt.Errorf("%w: merge %d (%q %q) uses a token missing from the vocabulary", ErrBadModelFile, rank, a, b)
		}
		k := uint64(ia)<<32 | uint64(ib)
		if _, dup := m.merges[k]; !dup { // the first (lowest) rank wins, as in HF
			m.merges[k] = uint64(rank)<<32 | uint64(im)
		}
	}
	return m, idToToken, nil
}

// parseComponent decodes one component of tokenizer.json's pipeline
// (what names it in errors); nil when it is absent or null.
func parseComponent(raw json.RawMessage, what string) (*component, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrBadModelFile, what, err)
	}
	return &c, nil
}

func buildNormalizer(raw json.RawMessage) (normalizer, error) {
	c, err := parseComponent(raw, "normalizer")
	if c == nil || err != nil {
		return nil, err
	}
	switch c.Type {
	case "NFC":
		return unicodeNormalizer(norm.NFC), nil
	case "NFD":
		return unicodeNormalizer(norm.NFD), nil
	case "NFKC":
		return unicodeNormalizer(norm.NFKC), nil
	case "NFKD":
		return unicodeNormalizer(norm.NFKD), nil
	case "Lowercase":
		return strings.ToLower, nil
	case "Prepend":
		return prependNormalizer(c.Prepend), nil
	case "Strip":
		return stripNormalizer(c.StripLeft, c.StripRight), nil
	case "Replace":
		switch {
		case c.Pattern.String != nil:
			return replaceNormalizer(*c.Pattern.String, c.Content), nil
		case c.Pattern.Regex != nil:
			re, err := regexp2.Compile(*c.Pattern.Regex, regexp2.Unicode)
			if err != nil {
				return nil, fmt.Errorf("%w: Replace normalizer pattern: %w", ErrUnsupported, err)
			}
			return regexReplaceNormalizer(re, c.Content), nil
		}
		return nil, fmt.Errorf("%w: Replace normalizer without pattern", ErrBadModelFile)
	case "Sequence":
		var ns []normalizer
		for _, r := range c.Normalizers {
			n, err := buildNormalizer(r)
			if err != nil {
				return nil, err
			}
			if n != nil {
				ns = append(ns, n)
			}
		}
		if len(ns) == 0 {
			return nil, nil
		}
		return sequenceNormalizer(ns), nil
	}
	return nil, fmt.Errorf("%w: normalizer %q", ErrUnsupported, c.Type)
}

// preStage is one pre-tokenizer step. first says whether the piece starts the input
// (Metaspace's prepend_scheme "first").
type preStage interface {
	apply(piece string, first bool, emit func(p string, first bool))
}

type splitStage struct{ s splitter }

func (s splitStage) apply(piece string, first bool, emit func(string, bool)) {
	s.s.split(piece, func(p string) {
		emit(p, first)
		first = false
	})
}

// prefixSpaceStage is ByteLevel's add_prefix_space: a space before every piece that does
// not start with one.
type prefixSpaceStage struct{}

func (prefixSpaceStage) apply(piece string, first bool, emit func(string, bool)) {
	if !strings.HasPrefix(piece, " ") {
		piece = " " + piece
	}
	emit(piece, first)
}

type metaspaceStage struct{ m metaspace }

func (s metaspaceStage) apply(piece string, first bool, emit func(string, bool)) {
	s.m.pieces(s.m.apply(piece, first), func(p string) {
		emit(p, first)
		first = false
	})
}

// buildPreTokenizer returns the stages and whether the model is byte-level.
func buildPreTokenizer(raw json.RawMessage) ([]preStage, bool, error) {
	c, err := parseComponent(raw, "pre_tokenizer")
	if c == nil || err != nil {
		return nil, false, err
	}
	switch c.Type {
	case "Sequence":
		var stages []preStage
		byteLevel := false
		for _, r := range c.Pretokenizers {
			s, bl, err := buildPreTokenizer(r)
			if err != nil {
				return nil, false, err
			}
			stages = append(stages, s...)
			byteLevel = byteLevel || bl
		}
		return stages, byteLevel, nil
	case "Split":
		var sp splitter
		switch {
		case c.Pattern.Regex != nil && !c.Invert && strings.EqualFold(c.Behavior, "Isolated") && *c.Pattern.Regex == llama3SplitPattern:
			sp = gptScanner{maxDigits: 3}
		case c.Pattern.Regex != nil && !c.Invert && strings.EqualFold(c.Behavior, "Isolated") && *c.Pattern.Regex == qwen2SplitPattern:
			sp = gptScanner{maxDigits: 1}
		case c.Pattern.Regex != nil:
			rs, err := newRegexSplitter(*c.Pattern.Regex, c.Behavior, c.Invert)
			if err != nil {
				return nil, false, err
			}
			sp = rs
		case c.Pattern.String != nil:
			rs, err := newRegexSplitter(regexp2.Escape(*c.Pattern.String), c.Behavior, c.Invert)
			if err != nil {
				return nil, false, err
			}
			sp = rs
		default:
			return nil, false, fmt.Errorf("%w: Split pre-tokenizer without pattern", ErrBadModelFile)
		}
		return []preStage{splitStage{sp}}, false, nil
	case "ByteLevel":
		var stages []preStage
		if c.AddPrefixSpace != nil && *c.AddPrefixSpace {
			stages = append(stages, prefixSpaceStage{})
		}
		// use_regex defaults to true in Hugging Face's ByteLevel.
		if c.UseRegex == nil || *c.UseRegex {
			rs, err := newRegexSplitter(gpt2Pattern, "Isolated", false)
			if err != nil {
				return nil, false, err
			}
			stages = append(stages, splitStage{rs})
		}
		return stages, true, nil
	case "Metaspace":
		m := metaspace{replacement: c.Replacement, prepend: strings.ToLower(c.PrependScheme), split: c.Split == nil || *c.Split}
		if m.replacement == "" {
			m.replacement = "▁"
		}
		if m.prepend == "" {
			// Older files: add_prefix_space (default true) means "always".
			m.prepend = "always"
			if c.AddPrefixSpace != nil && !*c.AddPrefixSpace {
				m.prepend = "never"
			}
		}
		switch m.prepend {
		case "always", "first", "never":
		default:
			return nil, false, fmt.Errorf("%w: Metaspace prepend_scheme %q", ErrUnsupported, c.PrependScheme)
		}
		return []preStage{metaspaceStage{m}}, false, nil
	}
	return nil, false, fmt.Errorf("%w: pre_tokenizer %q", ErrUnsupported, c.Type)
}

// Encode implements Tokenizer: added tokens first, then normalization, pre-tokenization
// and BPE on the text between them; no BOS/EOS is added. It never returns an error.
func (t *HF) Encode(text string) ([]uint32, error) {
	return t.encode(text, nil)
}

// EncodeContext implements ContextEncoder: Encode or EncodeSpecial, stopped with ctx's
// error when ctx ends first (checked every few thousand pieces and merges).
func (t *HF) EncodeContext(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("tokenizer: encoding stopped: %w", err)
	}
	if addSpecialTokens && t.postErr != nil {
		return nil, t.postErr
	}
	ids, err := t.encode(text, newStopper(ctx))
	if err != nil || !addSpecialTokens {
		return ids, err
	}
	return t.withSpecials(ids), nil
}

func (t *HF) encode(text string, stop *stopper) ([]uint32, error) {
	ids := make([]uint32, 0, len(text)/3+4)
	t.specials.split(text, func(seg string, off int) {
		if stop.stopped() {
			return
		}
		first := off == 0
		if t.segs != nil && len(seg) >= minSegment {
			if cached, ok := t.segs.get(seg, first); ok {
				ids = append(ids, cached...)
				return
			}
			n := len(ids)
			ids = t.encodeText(ids, seg, first, stop)
			if stop.failed() == nil {
				t.segs.put(seg, first, ids[n:])
			}
			return
		}
		ids = t.encodeText(ids, seg, first, stop)
	}, func(id uint32) { ids = append(ids, id) })
	if err := stop.failed(); err != nil {
		return nil, err
	}
	return ids, nil
}

// encodeText encodes the text between two raw-matched added tokens.
func (t *HF) encodeText(ids []uint32, seg string, first bool, stop *stopper) []uint32 {
	if t.norm != nil {
		seg = t.norm(seg)
	}
	t.normAdd.split(seg, func(seg2 string, off2 int) {
		ids = t.encodeSegment(ids, seg2, first && off2 == 0, stop)
	}, func(id uint32) { ids = append(ids, id) })
	return ids
}

func (t *HF) encodeSegment(ids []uint32, seg string, first bool, stop *stopper) []uint32 {
	if t.fast != nil {
		t.fast.split(seg, func(p string) { ids = t.encodePiece(ids, p, stop) })
		return ids
	}
	var run func(stages []preStage, piece string, first bool)
	run = func(stages []preStage, piece string, first bool) {
		if len(stages) == 0 {
			ids = t.encodePiece(ids, piece, stop)
			return
		}
		stages[0].apply(piece, first, func(p string, f bool) { run(stages[1:], p, f) })
	}
	run(t.pre, seg, first)
	return ids
}

func (t *HF) encodePiece(ids []uint32, piece string, stop *stopper) []uint32 {
	if piece == "" || stop.stopped() {
		return ids
	}
	if t.cache == nil {
		return t.model.encodePiece(ids, piece, stop)
	}
	if cached, ok := t.cache.get(piece); ok {
		return append(ids, cached...)
	}
	n := len(ids)
	ids = t.model.encodePiece(ids, piece, stop)
	if stop.failed() == nil {
		t.cache.put(piece, append([]uint32(nil), ids[n:]...))
	}
	return ids
}

// SpecialEncoder is implemented by tokenizers that can also encode with
// add_special_tokens=true, which is what vLLM does to a /v1/completions prompt (Llama 3
// puts <|begin_of_text|> first; Qwen3 adds nothing). Chat prompts are encoded without.
type SpecialEncoder interface {
	EncodeSpecial(text string) ([]uint32, error)
}

var _ SpecialEncoder = (*HF)(nil)

// EncodeSpecial encodes text with add_special_tokens=true: the post-processor's special
// tokens (tokenizer.json "post_processor": TemplateProcessing, Bert/RobertaProcessing)
// around Encode(text).
func (t *HF) EncodeSpecial(text string) ([]uint32, error) {
	if t.postErr != nil {
		return nil, t.postErr
	}
	ids, err := t.Encode(text)
	if err != nil {
		return nil, err
	}
	return t.withSpecials(ids), nil
}

// withSpecials puts the post-processor's special tokens around ids.
func (t *HF) withSpecials(ids []uint32) []uint32 {
	if len(t.prefix) == 0 && len(t.suffix) == 0 {
		return ids
	}
	out := make([]uint32, 0, len(t.prefix)+len(ids)+len(t.suffix))
	return append(append(append(out, t.prefix...), ids...), t.suffix...)
}

// buildPostProcessor reads the single-sequence special tokens of a post-processor.
func buildPostProcessor(raw json.RawMessage) (prefix, suffix []uint32, _ error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil, nil
	}
	var p struct {
		Type       string            `json:"type"`
		Processors []json.RawMessage `json:"processors"`
		Single     []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct {
				ID string `json:"id"`
			} `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []uint32 `json:"ids"`
		} `json:"special_tokens"`
		Cls []json.RawMessage `json:"cls"`
		Sep []json.RawMessage `json:"sep"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, nil, fmt.Errorf("%w: post_processor: %w", ErrBadModelFile, err)
	}
	switch p.Type {
	case "ByteLevel":
		return nil, nil, nil // offsets only
	case "Sequence":
		for _, r := range p.Processors {
			pre, suf, err := buildPostProcessor(r)
			if err != nil {
				return nil, nil, err
			}
			prefix, suffix = append(prefix, pre...), append(suffix, suf...)
		}
		return prefix, suffix, nil
	case "TemplateProcessing":
		seen := false
		for _, it := range p.Single {
			switch {
			case it.Sequence != nil:
				seen = true
			case it.SpecialToken != nil:
				st, ok := p.SpecialTokens[it.SpecialToken.ID]
				if !ok {
					return nil, nil, fmt.Errorf("%w: post_processor special token %q undefined", ErrBadModelFile, it.SpecialToken.ID)
				}
				if seen {
					suffix = append(suffix, st.IDs...)
				} else {
					prefix = append(prefix, st.IDs...)
				}
			}
		}
		return prefix, suffix, nil
	case "BertProcessing", "RobertaProcessing":
		// cls and sep are [token, id] pairs: [CLS] sequence [SEP].
		pairID := func(pair []json.RawMessage) (uint32, error) {
			var id uint32
			if len(pair) != 2 || json.Unmarshal(pair[1], &id) != nil {
				return 0, fmt.Errorf("%w: %s cls/sep must be [token, id]", ErrBadModelFile, p.Type)
			}
			return id, nil
		}
		cls, err := pairID(p.Cls)
		if err != nil {
			return nil, nil, err
		}
		sep, err := pairID(p.Sep)
		if err != nil {
			return nil, nil, err
		}
		return []uint32{cls}, []uint32{sep}, nil
	}
	return nil, nil, fmt.Errorf("%w: post_processor %q", ErrUnsupported, p.Type)
}

// Render implements ChatTemplate with the model's chat template: with a list of named
// templates, the one named "tool_use" when the request has tools (not null; an empty
// list counts, as vLLM passes it on) and the files have one, else "default" — what
// transformers' get_chat_template picks for vLLM.
func (t *HF) Render(msgs []Message, opts RenderOptions) (string, error) {
	tmpl := t.tmpl
	if t.toolTmpl != nil && len(opts.Tools) > 0 && string(opts.Tools) != "null" {
		tmpl = t.toolTmpl
	}
	if tmpl == nil {
		return "", ErrNoChatTemplate
	}
	return tmpl.Render(msgs, opts)
}

// HasChatTemplate reports whether the model files carried a chat template.
func (t *HF) HasChatTemplate() bool { return t.tmpl != nil }

// VocabSize is the number of ids, added tokens included.
func (t *HF) VocabSize() int { return len(t.idToToken) }

// CachedPieces reports how many pieces the cache holds (0 when disabled).
func (t *HF) CachedPieces() int {
	if t.cache == nil {
		return 0
	}
	return t.cache.len()
}

// ErrUnknownID is returned by Decode for an id outside the vocabulary.
var ErrUnknownID = errors.New("tokenizer: unknown token id")

// Decode turns ids back into text through the tokenizer.json decoder (ByteLevel, or the
// SentencePiece chain Replace/ByteFallback/Fuse/Strip, or Metaspace). Special tokens are
// kept, so Decode(Encode(s)) == s for byte-level models and valid UTF-8 s.
func (t *HF) Decode(ids []uint32) (string, error) {
	toks := make([]string, len(ids))
	for i, id := range ids {
		if int(id) >= len(t.idToToken) || t.idToToken[id] == "" {
			return "", fmt.Errorf("%w: %d", ErrUnknownID, id)
		}
		toks[i] = t.idToToken[id]
	}
	for _, d := range t.decoders {
		toks = d(t, toks)
	}
	return strings.Join(toks, ""), nil
}

// decoderStep transforms the token strings, as a step of Hugging Face's decode_chain.
type decoderStep func(t *HF, toks []string) []string

func buildDecoders(raw json.RawMessage) ([]decoderStep, error) {
	c, err := parseComponent(raw, "decoder")
	if c == nil || err != nil {
		return nil, err
	}
	switch c.Type {
	case "Sequence":
		var out []decoderStep
		for _, r := range c.Decoders {
			d, err := buildDecoders(r)
			if err != nil {
				return nil, err
			}
			out = append(out, d...)
		}
		return out, nil
	case "ByteLevel":
		return []decoderStep{decodeByteLevel}, nil
	case "ByteFallback":
		return []decoderStep{decodeByteFallback}, nil
	case "Fuse":
		return []decoderStep{func(_ *HF, toks []string) []string { return []string{strings.Join(toks, "")} }}, nil
	case "Replace":
		if c.Pattern.String == nil {
			return nil, fmt.Errorf("%w: Replace decoder with a regex", ErrUnsupported)
		}
		old, repl := *c.Pattern.String, c.Content
		return []decoderStep{func(_ *HF, toks []string) []string {
			for i := range toks {
				toks[i] = strings.ReplaceAll(toks[i], old, repl)
			}
			return toks
		}}, nil
	case "Strip":
		content, start, stop := c.Content, c.Start, c.Stop
		return []decoderStep{func(_ *HF, toks []string) []string {
			for i := range toks {
				s := toks[i]
				for n := 0; n < start && strings.HasPrefix(s, content); n++ {
					s = s[len(content):]
				}
				for n := 0; n < stop && strings.HasSuffix(s, content); n++ {
					s = s[:len(s)-len(content)]
				}
				toks[i] = s
			}
			return toks
		}}, nil
	case "Metaspace":
		rep := c.Replacement
		if rep == "" {
			rep = "▁"
		}
		prepend := strings.ToLower(c.PrependScheme) != "never" && (c.AddPrefixSpace == nil || *c.AddPrefixSpace || c.PrependScheme != "")
		return []decoderStep{func(_ *HF, toks []string) []string {
			for i := range toks {
				s := strings.ReplaceAll(toks[i], rep, " ")
				if i == 0 && prepend {
					s = strings.TrimPrefix(s, " ")
				}
				toks[i] = s
			}
			return toks
		}}, nil
	}
	return nil, fmt.Errorf("%w: decoder %q", ErrUnsupported, c.Type)
}

func decodeByteLevel(t *HF, toks []string) []string {
	var b bytes.Buffer
	for _, tok := range toks {
		for _, r := range tok {
			if c, ok := t.byteDec[r]; ok {
				b.WriteByte(c)
			} else {
				b.WriteRune(r) // added tokens are plain text
			}
		}
	}
	return []string{b.String()}
}

// decodeByteFallback turns runs of <0xNN> tokens into the bytes they stand for; a run that
// is not valid UTF-8 becomes one U+FFFD per byte, as Hugging Face does.
func decodeByteFallback(_ *HF, toks []string) []string {
	out := make([]string, 0, len(toks))
	var pending []byte
	flush := func() {
		if len(pending) == 0 {
			return
		}
		if s := string(pending); utf8.ValidString(s) {
			out = append(out, s)
		} else {
			for range pending {
				out = append(out, "\uFFFD")
			}
		}
		pending = pending[:0]
	}
	for _, tok := range toks {
		if len(tok) == 6 && strings.HasPrefix(tok, "<0x") && tok[5] == '>' {
			if v, err := strconv.ParseUint(tok[3:5], 16, 8); err == nil {
				pending = append(pending, byte(v))
				continue
			}
		}
		flush()
		out = append(out, tok)
	}
	flush()
	return out
}

func isWhite(r rune) bool { return unicode.IsSpace(r) }

// tokenizerConfig is what tokenizer_config.json contributes.
type tokenizerConfig struct {
	template string
	// toolTemplate is the named template "tool_use" (older files list named templates).
	toolTemplate string
	bos, eos     string
}

func parseTokenizerConfig(b []byte) (tokenizerConfig, error) {
	var tc tokenizerConfig
	if len(b) == 0 {
		return tc, nil
	}
	var raw struct {
		ChatTemplate json.RawMessage `json:"chat_template"`
		BOS          json.RawMessage `json:"bos_token"`
		EOS          json.RawMessage `json:"eos_token"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return tc, fmt.Errorf("%w: tokenizer_config.json: %w", ErrBadModelFile, err)
	}
	tc.bos, tc.eos = specialTokenString(raw.BOS), specialTokenString(raw.EOS)
	if len(raw.ChatTemplate) > 0 && string(raw.ChatTemplate) != "null" {
		if err := json.Unmarshal(raw.ChatTemplate, &tc.template); err != nil {
			// Older files: a list of named templates; vLLM (through transformers'
			// get_chat_template) uses "tool_use" for requests with tools, else "default".
			var named []struct {
				Name     string `json:"name"`
				Template string `json:"template"`
			}
			if err := json.Unmarshal(raw.ChatTemplate, &named); err != nil {
				return tc, fmt.Errorf("%w: tokenizer_config.json chat_template: %w", ErrBadModelFile, err)
			}
			for _, n := range named {
				switch n.Name {
				case "default":
					tc.template = n.Template
				case "tool_use":
					tc.toolTemplate = n.Template
				}
			}
		}
	}
	return tc, nil
}

// specialTokenString reads bos_token/eos_token, written either as a string or as an
// AddedToken object {"content": ...}; null or absent is "".
func specialTokenString(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var obj struct {
		Content string `json:"content"`
	}
	if json.Unmarshal(raw, &obj) == nil {
		return obj.Content
	}
	return ""
}
