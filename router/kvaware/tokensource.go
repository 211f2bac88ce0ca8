package kvaware

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// Token sources (TokenizerConfig.Source).
const (
	TokenSourceNone   = "none"   // no tokens: kv_aware routes heuristically unless the request carries ids
	TokenSourceSimple = "simple" // the simulator's dummy tokenizer (kvsim, llm-d-inference-sim)
	TokenSourceFiles  = "files"  // the model's tokenizer.json + tokenizer_config.json, in process
	TokenSourceEngine = "engine" // the engine's /tokenize endpoint
)

var _ router.TokenSource = (*ChatTokenSource)(nil)

// NewTokenSource builds a pool's token source from its tokenizer config.
// nil config or source "none" returns nil (no source). The engine source
// calls tokenizer.url, else the pool's first instance (every instance of a
// pool serves the same model, hence the same tokenizer and template).
func NewTokenSource(cfg *config.TokenizerConfig, pool config.PoolConfig) (router.TokenSource, error) {
	if cfg == nil {
		return nil, nil
	}
	switch cfg.Source {
	case "", TokenSourceNone:
		return nil, nil
	case TokenSourceSimple:
		return &ChatTokenSource{Tokenizer: tokenizer.Local(tokenizer.Simple{})}, nil
	case TokenSourceFiles:
		if cfg.Path == "" {
			return nil, fmt.Errorf("%w: tokenizer.path is required for source %q", router.ErrTokenSource, cfg.Source)
		}
		hf, err := tokenizer.LoadHF(cfg.Path, tokenizer.HFConfig{})
		if err != nil {
			return nil, fmt.Errorf("%w: load %s: %w", router.ErrTokenSource, cfg.Path, err)
		}
		return &ChatTokenSource{Tokenizer: tokenizer.Local(hf)}, nil
	case TokenSourceEngine:
		u := cfg.URL
		if u == "" && len(pool.Instances) > 0 {
			u = pool.Instances[0].URL
		}
		r, err := tokenizer.NewRemote(tokenizer.RemoteConfig{URL: u, Model: pool.Model})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", router.ErrTokenSource, err)
		}
		return &ChatTokenSource{Tokenizer: r}, nil
	}
	return nil, fmt.Errorf("%w: unknown source %q", router.ErrTokenSource, cfg.Source)
}

// ChatTokenSource adapts a tokenizer.PromptTokenizer (Simple or HF through
// tokenizer.Local, or the engine's /tokenize client tokenizer.Remote) to
// TokenSource: chat requests are rendered with the model's chat template
// and encoded with add_special_tokens=false, as vLLM does; completions
// prompts are encoded as text.
//
// Completions text prompts are encoded as vLLM does: with the request's
// add_special_tokens, true when absent, so a Llama 3 prompt gets its
// <|begin_of_text|> (tokenizer.CompletionTokenizer, which Local and Remote
// implement).
type ChatTokenSource struct {
	Tokenizer tokenizer.PromptTokenizer
}

// encode tokenizes a completions text prompt as vLLM does.
func (s *ChatTokenSource) encode(ctx context.Context, text string, add bool) ([]uint32, error) {
	ct, ok := s.Tokenizer.(tokenizer.CompletionTokenizer)
	if !ok {
		return s.Tokenizer.TokenizeText(ctx, text)
	}
	return ct.TokenizeCompletion(ctx, text, add)
}

// text tokenizes a completions text prompt as vLLM does, truncated on the
// left to its last keep tokens (0: all; truncation). The tokenizer
// truncates the text's own tokens and then adds its special tokens, which
// count in keep (a Llama 3 prompt keeps <|begin_of_text|> and its last
// keep − 1 tokens), so the text is encoded a second time without them to
// tell them apart.
func (s *ChatTokenSource) text(ctx context.Context, text string, add bool, keep int) ([]uint32, error) {
	ids, err := s.encode(ctx, text, add)
	if err != nil || keep <= 0 || len(ids) <= keep {
		return ids, err
	}
	if !add {
		return router.KeepLast(ids, keep), nil
	}
	plain, err := s.encode(ctx, text, false)
	if err != nil {
		return nil, err
	}
	n := len(ids) - len(plain) // the special tokens
	at := -1
	for p := 0; p <= n && n >= 0; p++ {
		if slices.Equal(ids[p:p+len(plain)], plain) {
			at = p
			break
		}
	}
	if at < 0 || keep <= n {
		return nil, fmt.Errorf("%w: truncate_prompt_tokens %d: the prompt's special tokens are not where the router expects them", router.ErrTokenSource, keep)
	}
	out := make([]uint32, 0, keep)
	out = append(out, ids[:at]...)
	out = append(out, plain[len(plain)-(keep-n):]...)
	return append(out, ids[at+len(plain):]...), nil
}

// bodyMember is a raw body's top-level member key (exact, as vLLM reads
// it), nil when absent: the raw invoke path, which has no parsed request.
func bodyMember(body []byte, key string) json.RawMessage {
	if !bytes.Contains(body, []byte(`"`+key+`"`)) && !bytes.Contains(body, []byte(`\u`)) {
		return nil // no key that could decode to key
	}
	return openai.TopLevelRaw(body, key)
}

// addSpecialTokens is a body's add_special_tokens, true unless false.
func addSpecialTokens(body []byte) bool {
	return rawAddSpecialTokens(bodyMember(body, "add_special_tokens"))
}

// truncation is how many of the prompt's last tokens the engine prefills
// (0: all), from the request's truncate_prompt_tokens
// (router.PromptTruncation); an error when the router cannot tell (-1:
// the model's max_model_len), so that kv_aware routes heuristically.
func truncation(req *router.Request) (int, error) {
	var v, side json.RawMessage
	if req.Parsed != nil {
		v, side = req.Parsed.TruncatePromptTokens, req.Parsed.TruncationSide
	} else {
		v, side = bodyMember(req.Body, "truncate_prompt_tokens"), bodyMember(req.Body, "truncation_side")
	}
	keep, err := router.PromptTruncationSide(v, side)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", router.ErrTokenSource, err)
	}
	return keep, nil
}

// rawAddSpecialTokens reads a raw add_special_tokens value: only false
// turns the special tokens off.
func rawAddSpecialTokens(v json.RawMessage) bool {
	return string(v) != "false"
}

// chatBody is what rendering needs from an OpenAI chat body (vLLM's extra
// fields included).
type chatBody struct {
	Messages             []tokenizer.Message `json:"messages"`
	Tools                json.RawMessage     `json:"tools"`
	Documents            json.RawMessage     `json:"documents"`
	AddGenerationPrompt  *bool               `json:"add_generation_prompt"`
	ContinueFinalMessage bool                `json:"continue_final_message"`
	ChatTemplateKwargs   map[string]any      `json:"chat_template_kwargs"`
	AddSpecialTokens     bool                `json:"add_special_tokens"`
}

// Tokens implements TokenSource.
func (s *ChatTokenSource) Tokens(ctx context.Context, req *router.Request) ([]uint32, error) {
	if s == nil || s.Tokenizer == nil {
		return nil, router.ErrNoTokens
	}
	if len(req.Body) > config.MaxTokenizeBytes {
		return nil, fmt.Errorf("%w: body of %d bytes exceeds %d", router.ErrTokenSource, len(req.Body), config.MaxTokenizeBytes)
	}
	keep, err := truncation(req)
	if err != nil {
		return nil, err
	}
	switch req.Endpoint {
	case router.EndpointCompletions:
		if req.Parsed != nil && req.Parsed.Prompt != nil && len(req.Parsed.Prompt.Texts) > 0 {
			return s.text(ctx, req.Parsed.Prompt.Texts[0], rawAddSpecialTokens(req.Parsed.AddSpecialTokens), keep)
		}
		return nil, router.ErrNoTokens
	case router.EndpointChatCompletions, router.EndpointInvoke, router.EndpointInvokeStream:
	default:
		return nil, router.ErrNoTokens
	}
	// The raw invoke path carries whatever body the engine's /invocations
	// accepts: an OpenAI chat or completions body.
	if !bytes.Contains(req.Body, []byte(`"messages"`)) && req.Endpoint != router.EndpointChatCompletions {
		return s.promptTokens(ctx, req.Body, keep)
	}
	parsed := req.Parsed
	if parsed == nil {
		// A raw /invocations body the router did not parse: the scan that
		// checks the default limits as it goes reads it first, so a body
		// of many small members is refused before encoding/json builds it
		// (a 4 MiB body of empty messages allocated 1,177 MB).
		if parsed, err = router.ParseOpenAI(router.EndpointInvoke, req.Body); err != nil {
			return nil, fmt.Errorf("%w: chat body: %w", router.ErrTokenSource, err)
		}
	}
	b, ok, err := parsedChatBody(parsed)
	if err != nil {
		return nil, err
	}
	if !ok {
		if b, err = parseChatBody(req.Body); err != nil {
			return nil, err
		}
	}
	if len(b.Messages) == 0 {
		return nil, router.ErrNoTokens
	}
	// vLLM's chat add_special_tokens (default false) adds the tokenizer's
	// special tokens to the rendered prompt.
	opts := tokenizer.RenderOptions{AddGenerationPrompt: true, Tools: b.Tools, Documents: b.Documents, Vars: b.ChatTemplateKwargs, AddSpecialTokens: b.AddSpecialTokens}
	if b.AddGenerationPrompt != nil {
		opts.AddGenerationPrompt = *b.AddGenerationPrompt
	}
	if b.ContinueFinalMessage {
		// vLLM refuses add_generation_prompt sent true with it (a 400:
		// ChatCompletionRequest's check_generation_prompt), and otherwise
		// cuts the render after the final message's text (transformers'
		// continue_final_message), which the generation prompt follows.
		if b.AddGenerationPrompt != nil && *b.AddGenerationPrompt {
			return nil, fmt.Errorf("%w: chat body: continue_final_message and add_generation_prompt both true", router.ErrTokenSource)
		}
		opts.AddGenerationPrompt, opts.ContinueFinalMessage = false, true
	}
	// The rendered template is encoded without special tokens, truncated
	// on the left as a text prompt is.
	ids, err := s.Tokenizer.TokenizeChat(ctx, b.Messages, opts)
	return router.KeepLast(ids, keep), err
}

// parsedChatBody builds the chat body from the request as ParseOpenAI
// decoded it, without reading the body again; ok is false for shapes it
// does not hold (no parsed request, content parts, tool calls), which take
// parseChatBody. Values of the wrong type are errors, as encoding/json's are.
func parsedChatBody(r *openai.Request) (b chatBody, ok bool, err error) {
	if r == nil {
		return b, false, nil
	}
	for _, m := range r.Messages {
		if m.Content.Array || (len(m.ToolCalls) > 0 && string(m.ToolCalls) != "null") {
			return b, false, nil
		}
	}
	b.Tools = r.Tools // "tools": [] stays [] (vLLM's tool_dicts)
	b.Documents = r.Documents
	if err := unmarshalRaw("add_generation_prompt", r.AddGenerationPrompt, &b.AddGenerationPrompt); err != nil {
		return b, false, err
	}
	if err := unmarshalRaw("continue_final_message", r.ContinueFinalMessage, &b.ContinueFinalMessage); err != nil {
		return b, false, err
	}
	if err := unmarshalRaw("chat_template_kwargs", r.ChatTemplateKwargs, &b.ChatTemplateKwargs); err != nil {
		return b, false, err
	}
	if err := unmarshalRaw("add_special_tokens", r.AddSpecialTokens, &b.AddSpecialTokens); err != nil {
		return b, false, err
	}
	b.Messages = make([]tokenizer.Message, len(r.Messages))
	for i, m := range r.Messages {
		tm := &b.Messages[i]
		tm.Role = m.Role
		if len(m.Content.Parts) > 0 {
			tm.Content = m.Content.Parts[0]
		} else {
			tm.ContentNull = true
		}
		var okN, okID, okR, okRC bool
		tm.Name, okN = openai.RawString(m.Name)
		tm.NameSet = len(m.Name) > 0 && string(m.Name) != "null"
		tm.ToolCallID, okID = openai.RawString(m.ToolCallID)
		tm.Reasoning, okR = openai.RawString(m.Reasoning)
		// vLLM gives the template reasoning when it is not None, "" too.
		tm.ReasoningSet = len(m.Reasoning) > 0 && string(m.Reasoning) != "null"
		tm.ReasoningContent, okRC = openai.RawString(m.ReasoningContent)
		tm.Tools = m.Tools
		if !okN || !okID || !okR || !okRC {
			return b, false, fmt.Errorf("%w: chat body: messages[%d]: name, tool_call_id, reasoning and reasoning_content must be strings", router.ErrTokenSource, i)
		}
	}
	return b, true, nil
}

// unmarshalRaw decodes a raw member (absent: dst unchanged).
func unmarshalRaw(field string, v json.RawMessage, dst any) error {
	if len(v) == 0 {
		return nil
	}
	if err := json.Unmarshal(v, dst); err != nil {
		return fmt.Errorf("%w: chat body: %s: %w", router.ErrTokenSource, field, err)
	}
	return nil
}

// parseChatBody decodes a chat body whole: the shapes parsedChatBody does
// not hold (content parts, tool calls), which Tokens reads here after the
// limit-checking scan. Keys are exact, as vLLM's (tokenizer.UnmarshalExact:
// a case variant such as "Messages" is ignored, not read as messages).
func parseChatBody(body []byte) (chatBody, error) {
	var b chatBody
	if err := tokenizer.UnmarshalExact(body, &b); err != nil {
		return b, fmt.Errorf("%w: chat body: %w", router.ErrTokenSource, err)
	}
	return b, nil
}

// promptTokens encodes a raw body's "prompt" (or "inputs") string, or
// returns its token ids, truncated to their last keep (0: all).
func (s *ChatTokenSource) promptTokens(ctx context.Context, body []byte, keep int) ([]uint32, error) {
	var b struct {
		Prompt *openai.Prompt   `json:"prompt"`
		Inputs *json.RawMessage `json:"inputs"`
	}
	if err := tokenizer.UnmarshalExact(body, &b); err != nil {
		return nil, fmt.Errorf("%w: body: %w", router.ErrTokenSource, err)
	}
	if b.Prompt == nil && b.Inputs != nil {
		b.Prompt = &openai.Prompt{}
		if err := b.Prompt.UnmarshalJSON(*b.Inputs); err != nil {
			return nil, fmt.Errorf("%w: inputs: %w", router.ErrTokenSource, err)
		}
	}
	switch {
	case b.Prompt == nil:
		return nil, router.ErrNoTokens
	case len(b.Prompt.Tokens) > 0:
		return router.KeepLast(b.Prompt.Tokens[0], keep), nil
	case len(b.Prompt.Texts) > 0:
		return s.text(ctx, b.Prompt.Texts[0], addSpecialTokens(body), keep)
	}
	return nil, router.ErrNoTokens
}
