package tokenizer

import (
	"bytes"
	"container/list"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"
)

// PromptTokenizer is what a request path needs, whatever the source of tokens: text to
// ids (TokenizeText: add_special_tokens=false, the text exactly) and chat messages to the
// ids of the rendered template (TokenizeChat: add_special_tokens=false, as vLLM does).
// Remote implements it with one HTTP round trip per uncached prompt; Local adapts an
// in-process ChatTokenizer. Both also implement CompletionTokenizer.
type PromptTokenizer interface {
	TokenizeText(ctx context.Context, text string) ([]uint32, error)
	TokenizeChat(ctx context.Context, msgs []Message, opts RenderOptions) ([]uint32, error)
}

// CompletionTokenizer gives the ids vLLM prefills for a /v1/completions prompt. vLLM's
// add_special_tokens defaults to true there, so a Llama 3 prompt starts with
// <|begin_of_text|> (TokenizeText would miss it and shift every block by one token);
// pass the request's add_special_tokens, true when absent.
type CompletionTokenizer interface {
	TokenizeCompletion(ctx context.Context, prompt string, addSpecialTokens bool) ([]uint32, error)
}

// Local adapts an in-process tokenizer (Simple or HF) to PromptTokenizer.
func Local(t ChatTokenizer) PromptTokenizer { return local{t} }

type local struct{ t ChatTokenizer }

func (l local) TokenizeText(ctx context.Context, text string) ([]uint32, error) {
	return l.encode(ctx, text, false)
}

// TokenizeCompletion implements CompletionTokenizer; with addSpecialTokens it needs a
// SpecialEncoder (Simple and HF are), else it fails.
func (l local) TokenizeCompletion(ctx context.Context, prompt string, addSpecialTokens bool) ([]uint32, error) {
	return l.encode(ctx, prompt, addSpecialTokens)
}

// TokenizeChat renders and encodes msgs; ctx bounds the encoding (a template renders in
// one go, so ctx is checked before and after it).
func (l local) TokenizeChat(ctx context.Context, msgs []Message, opts RenderOptions) ([]uint32, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("tokenizer: stopped before rendering: %w", err)
	}
	text, err := l.t.Render(msgs, opts)
	if err != nil {
		return nil, err
	}
	return l.encode(ctx, text, opts.AddSpecialTokens)
}

// encode encodes text in process, within ctx when the tokenizer can stop (a
// ContextEncoder: HF), else checking ctx only before it starts.
func (l local) encode(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error) {
	if c, ok := l.t.(ContextEncoder); ok {
		return c.EncodeContext(ctx, text, addSpecialTokens)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("tokenizer: encoding stopped: %w", err)
	}
	if !addSpecialTokens {
		return l.t.Encode(text)
	}
	s, ok := l.t.(SpecialEncoder)
	if !ok {
		return nil, fmt.Errorf("%w: %T cannot add special tokens", ErrUnsupported, l.t)
	}
	return s.EncodeSpecial(text)
}

// ContextEncoder is a tokenizer whose encoding stops with ctx's error when ctx ends
// (HF: a long prompt takes seconds, and the router's tokenize timeout must bound it).
// addSpecialTokens as in SpecialEncoder.
type ContextEncoder interface {
	EncodeContext(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error)
}

var _ ContextEncoder = (*HF)(nil)

// ErrRemote reports a failed call to an engine's /tokenize endpoint.
var ErrRemote = errors.New("tokenizer: remote /tokenize")

// RemoteConfig configures a Remote tokenizer. The zero value is invalid only for URL.
type RemoteConfig struct {
	// URL is the engine's base URL (e.g. "http://10.0.0.7:8000"); requests go to URL +
	// "/tokenize". Required.
	URL string
	// Model fills the request's "model" field; empty omits it (vLLM then uses its only model).
	Model string
	// Timeout bounds one call when the caller's context has no earlier deadline. 0 means
	// 2 s: a prompt tokenized by the engine is a fallback, never worth stalling a request on.
	Timeout time.Duration
	// CacheEntries bounds the LRU of prompt → ids. 0 means 4,096 prompts; negative disables.
	CacheEntries int
	// Client is the HTTP client; nil means a client with default transport.
	Client *http.Client
}

// Remote tokenizes through a vLLM server's /tokenize endpoint (request shapes
// TokenizeCompletionRequest {model, prompt, add_special_tokens} and TokenizeChatRequest
// {model, messages, add_generation_prompt, add_special_tokens, tools,
// chat_template_kwargs}; response TokenizeResponse {count, max_model_len, tokens}, per
// vllm/entrypoints/openai protocol). Results are cached in an LRU keyed by a 128-bit
// hash of the request. Safe for concurrent use.
type Remote struct {
	endpoint string
	cfg      RemoteConfig
	client   *http.Client
	lru      *lruCache // nil when disabled
}

var (
	_ Tokenizer           = (*Remote)(nil)
	_ SpecialEncoder      = (*Remote)(nil)
	_ PromptTokenizer     = (*Remote)(nil)
	_ PromptTokenizer     = local{}
	_ CompletionTokenizer = (*Remote)(nil)
	_ CompletionTokenizer = local{}
)

// NewRemote validates cfg and returns a Remote tokenizer. It does not contact the engine.
func NewRemote(cfg RemoteConfig) (*Remote, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%w: remote URL %q must be an absolute http(s) URL", ErrConfig, cfg.URL)
	}
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("%w: remote timeout %v must not be negative", ErrConfig, cfg.Timeout)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 2 * time.Second
	}
	r := &Remote{endpoint: strings.TrimSuffix(cfg.URL, "/") + "/tokenize", cfg: cfg, client: cfg.Client}
	if r.client == nil {
		r.client = &http.Client{}
	}
	switch {
	case cfg.CacheEntries == 0:
		r.lru = newLRU(4096)
	case cfg.CacheEntries > 0:
		r.lru = newLRU(cfg.CacheEntries)
	}
	return r, nil
}

// Encode implements Tokenizer (add_special_tokens=false) with a background context
// bounded by the configured timeout.
func (r *Remote) Encode(text string) ([]uint32, error) {
	return r.EncodeText(context.Background(), text, false)
}

// EncodeSpecial implements SpecialEncoder (add_special_tokens=true).
func (r *Remote) EncodeSpecial(text string) ([]uint32, error) {
	return r.EncodeText(context.Background(), text, true)
}

// TokenizeText implements PromptTokenizer (add_special_tokens=false).
func (r *Remote) TokenizeText(ctx context.Context, text string) ([]uint32, error) {
	return r.EncodeText(ctx, text, false)
}

// TokenizeCompletion implements CompletionTokenizer.
func (r *Remote) TokenizeCompletion(ctx context.Context, prompt string, addSpecialTokens bool) ([]uint32, error) {
	return r.EncodeText(ctx, prompt, addSpecialTokens)
}

// EncodeText asks the engine to encode text, with or without the model's special tokens.
func (r *Remote) EncodeText(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error) {
	type req struct {
		Model            string `json:"model,omitempty"`
		Prompt           string `json:"prompt"`
		AddSpecialTokens bool   `json:"add_special_tokens"`
	}
	// Key on the text itself so a cache hit skips JSON encoding of a long prompt.
	var key lruKey
	if r.lru != nil {
		kind := "text\x00"
		if addSpecialTokens {
			kind = "text+special\x00"
		}
		key = r.lru.key(kind, text)
	}
	return r.call(ctx, key, req{Model: r.cfg.Model, Prompt: text, AddSpecialTokens: addSpecialTokens})
}

// TokenizeChat implements PromptTokenizer: the engine renders its own chat template, so
// the ids are exactly what it will prefill. opts.Now is not sent (the engine's clock wins).
func (r *Remote) TokenizeChat(ctx context.Context, msgs []Message, opts RenderOptions) ([]uint32, error) {
	type req struct {
		Model               string          `json:"model,omitempty"`
		Messages            []Message       `json:"messages"`
		AddGenerationPrompt bool            `json:"add_generation_prompt"`
		AddSpecialTokens    bool            `json:"add_special_tokens"`
		ContinueFinal       bool            `json:"continue_final_message,omitempty"`
		Tools               json.RawMessage `json:"tools,omitempty"`
		Documents           json.RawMessage `json:"documents,omitempty"`
		ChatTemplateKwargs  map[string]any  `json:"chat_template_kwargs,omitempty"`
	}
	return r.call(ctx, lruKey{}, req{Model: r.cfg.Model, Messages: msgs, AddGenerationPrompt: opts.AddGenerationPrompt,
		AddSpecialTokens: opts.AddSpecialTokens, ContinueFinal: opts.ContinueFinalMessage, Tools: opts.Tools, Documents: opts.Documents, ChatTemplateKwargs: opts.Vars})
}

// maxResponse bounds the /tokenize response read (a 1M-token prompt is ~8 MB of JSON).
const maxResponse = 32 << 20

// call posts body; key is its cache key, or zero to key on the encoded body.
func (r *Remote) call(ctx context.Context, key lruKey, body any) ([]uint32, error) {
	if r.lru != nil && key != (lruKey{}) {
		if ids, ok := r.lru.get(key); ok {
			return ids, nil
		}
	}
	payload, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("%w: encode request: %w", ErrRemote, err)
	}
	if r.lru != nil && key == (lruKey{}) {
		key = r.lru.key("chat\x00", string(payload))
		if ids, ok := r.lru.get(key); ok {
			return ids, nil
		}
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.endpoint, bytes.NewReader(payload))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrRemote, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := r.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrRemote, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponse))
	if err != nil {
		return nil, fmt.Errorf("%w: read response: %w", ErrRemote, err)
	}
	if resp.StatusCode != http.StatusOK {
		snippet := strings.TrimSpace(string(data))
		if len(snippet) > 200 {
			snippet = snippet[:200] + "..."
		}
		return nil, fmt.Errorf("%w: %s: status %d: %s", ErrRemote, r.endpoint, resp.StatusCode, snippet)
	}
	var out struct {
		Count  *int      `json:"count"`
		Tokens *[]uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%w: decode response: %w", ErrRemote, err)
	}
	if out.Tokens == nil {
		return nil, fmt.Errorf("%w: response has no \"tokens\"", ErrRemote)
	}
	if out.Count != nil && *out.Count != len(*out.Tokens) {
		return nil, fmt.Errorf("%w: response count %d but %d tokens", ErrRemote, *out.Count, len(*out.Tokens))
	}
	ids := *out.Tokens
	if r.lru != nil {
		r.lru.put(key, slices.Clone(ids))
	}
	return ids, nil
}

// CachedPrompts reports how many prompts the LRU holds.
func (r *Remote) CachedPrompts() int {
	if r.lru == nil {
		return 0
	}
	return r.lru.len()
}

// lruKey is a 128-bit hash of a request body: prompts can be hundreds of KB, so the body
// itself is not kept; two independent 64-bit seeds make a collision practically impossible.
type lruKey [2]uint64

type lruCache struct {
	seeds [2]maphash.Seed
	max   int

	mu    sync.Mutex // guards order and items
	order *list.List // front = most recently used; values are *lruEntry
	items map[lruKey]*list.Element
}

type lruEntry struct {
	key lruKey
	ids []uint32
}

func newLRU(n int) *lruCache {
	return &lruCache{seeds: [2]maphash.Seed{maphash.MakeSeed(), maphash.MakeSeed()}, max: n,
		order: list.New(), items: make(map[lruKey]*list.Element)}
}

func (c *lruCache) key(kind, s string) lruKey {
	var k lruKey
	for i := range k {
		var h maphash.Hash
		h.SetSeed(c.seeds[i])
		h.WriteString(kind)
		h.WriteString(s)
		k[i] = h.Sum64()
	}
	return k
}

func (c *lruCache) get(k lruKey) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.items[k]
	if !ok {
		return nil, false
	}
	c.order.MoveToFront(e)
	// A copy: callers own what they get and may append to it.
	return slices.Clone(e.Value.(*lruEntry).ids), true
}

func (c *lruCache) put(k lruKey, ids []uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[k]; ok {
		e.Value.(*lruEntry).ids = ids
		c.order.MoveToFront(e)
		return
	}
	c.items[k] = c.order.PushFront(&lruEntry{key: k, ids: ids})
	for c.order.Len() > c.max {
		last := c.order.Back()
		c.order.Remove(last)
		delete(c.items, last.Value.(*lruEntry).key)
	}
}

func (c *lruCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.order.Len()
}
