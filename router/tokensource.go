package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvrouter/kvrouter/tokenizer"
)

// Token sources (TokenizerConfig.Source).
const (
	TokenSourceNone   = "none"   // no tokens: kv_aware routes heuristically unless the request carries ids
	TokenSourceSimple = "simple" // the simulator's dummy tokenizer (kvsim, llm-d-inference-sim)
	TokenSourceFiles  = "files"  // the model's tokenizer.json + tokenizer_config.json, in process
	TokenSourceEngine = "engine" // the engine's /tokenize endpoint
)

// ErrTokenSource reports a token source that cannot be built, or a body
// it cannot tokenize.
var ErrTokenSource = errors.New("router: token source")

// MaxTokenizeBytes caps the bodies a token source tokenizes: 4 MiB is
// about a million tokens of text, eight times a 128k-token context. A
// larger body routes heuristically rather than costing the router
// hundreds of milliseconds of CPU (the engine will reject it anyway).
const MaxTokenizeBytes = 4 << 20

var _ TokenSource = (*ChatTokenSource)(nil)

// NewTokenSource builds a pool's token source from its tokenizer config.
// nil config or source "none" returns nil (no source). The engine source
// calls tokenizer.url, else the pool's first instance (every instance of a
// pool serves the same model, hence the same tokenizer and template).
func NewTokenSource(cfg *TokenizerConfig, pool PoolConfig) (TokenSource, error) {
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
			return nil, fmt.Errorf("%w: tokenizer.path is required for source %q", ErrTokenSource, cfg.Source)
		}
		hf, err := tokenizer.LoadHF(cfg.Path, tokenizer.HFConfig{})
		if err != nil {
			return nil, fmt.Errorf("%w: load %s: %w", ErrTokenSource, cfg.Path, err)
		}
		return &ChatTokenSource{Tokenizer: tokenizer.Local(hf)}, nil
	case TokenSourceEngine:
		u := cfg.URL
		if u == "" && len(pool.Instances) > 0 {
			u = pool.Instances[0].URL
		}
		r, err := tokenizer.NewRemote(tokenizer.RemoteConfig{URL: u, Model: pool.Model})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrTokenSource, err)
		}
		return &ChatTokenSource{Tokenizer: r}, nil
	}
	return nil, fmt.Errorf("%w: unknown source %q", ErrTokenSource, cfg.Source)
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

// text tokenizes a completions text prompt as vLLM does.
func (s *ChatTokenSource) text(ctx context.Context, text string, body []byte) ([]uint32, error) {
	ct, ok := s.Tokenizer.(tokenizer.CompletionTokenizer)
	if !ok {
		return s.Tokenizer.TokenizeText(ctx, text)
	}
	add := true
	if bytes.Contains(body, []byte(`"add_special_tokens"`)) {
		var v struct {
			Add *bool `json:"add_special_tokens"`
		}
		if json.Unmarshal(body, &v) == nil && v.Add != nil {
			add = *v.Add
		}
	}
	return ct.TokenizeCompletion(ctx, text, add)
}

// chatBody is what rendering needs from an OpenAI chat body (vLLM's extra
// fields included).
type chatBody struct {
	Messages             []tokenizer.Message `json:"messages"`
	Tools                json.RawMessage     `json:"tools"`
	AddGenerationPrompt  *bool               `json:"add_generation_prompt"`
	ContinueFinalMessage bool                `json:"continue_final_message"`
	ChatTemplateKwargs   map[string]any      `json:"chat_template_kwargs"`
}

// Tokens implements TokenSource.
func (s *ChatTokenSource) Tokens(ctx context.Context, req *Request) ([]uint32, error) {
	if s == nil || s.Tokenizer == nil {
		return nil, ErrNoTokens
	}
	if len(req.Body) > MaxTokenizeBytes {
		return nil, fmt.Errorf("%w: body of %d bytes exceeds %d", ErrTokenSource, len(req.Body), MaxTokenizeBytes)
	}
	switch req.Endpoint {
	case EndpointCompletions:
		if req.Parsed != nil && req.Parsed.Prompt != nil && len(req.Parsed.Prompt.Texts) > 0 {
			return s.text(ctx, req.Parsed.Prompt.Texts[0], req.Body)
		}
		return nil, ErrNoTokens
	case EndpointChatCompletions, EndpointInvoke, EndpointInvokeStream:
	default:
		return nil, ErrNoTokens
	}
	// The raw invoke path carries whatever body the engine's /invocations
	// accepts: an OpenAI chat or completions body.
	if !bytes.Contains(req.Body, []byte(`"messages"`)) && req.Endpoint != EndpointChatCompletions {
		return s.promptTokens(ctx, req.Body)
	}
	b, err := parseChatBody(req.Body)
	if err != nil {
		return nil, err
	}
	if len(b.Messages) == 0 {
		return nil, ErrNoTokens
	}
	opts := tokenizer.RenderOptions{AddGenerationPrompt: true, Tools: b.Tools, Vars: b.ChatTemplateKwargs}
	if b.AddGenerationPrompt != nil {
		opts.AddGenerationPrompt = *b.AddGenerationPrompt
	}
	if b.ContinueFinalMessage {
		// vLLM then renders without a generation prompt and cuts the final
		// message's end-of-turn; rendering without the generation prompt
		// gets every block but the last right.
		opts.AddGenerationPrompt = false
	}
	return s.Tokenizer.TokenizeChat(ctx, b.Messages, opts)
}

// fastChatBody is chatBody with plain-string contents: decoding a long
// string straight into a string scans it three times, where
// tokenizer.Message's flexible content (string, null or parts) costs six
// passes — most of a long chat's routing time. Bodies it cannot hold
// (content parts, tool calls) take the general path.
type fastChatBody struct {
	Messages []struct {
		Role             string          `json:"role"`
		Content          *string         `json:"content"`
		Name             string          `json:"name"`
		ToolCallID       string          `json:"tool_call_id"`
		ReasoningContent string          `json:"reasoning_content"`
		ToolCalls        json.RawMessage `json:"tool_calls"`
	} `json:"messages"`
	Tools                json.RawMessage `json:"tools"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
	ChatTemplateKwargs   map[string]any  `json:"chat_template_kwargs"`
}

// parseChatBody decodes a chat body, fast when every content is a string.
func parseChatBody(body []byte) (chatBody, error) {
	var f fastChatBody
	if json.Unmarshal(body, &f) == nil {
		b := chatBody{Tools: f.Tools, AddGenerationPrompt: f.AddGenerationPrompt, ContinueFinalMessage: f.ContinueFinalMessage, ChatTemplateKwargs: f.ChatTemplateKwargs}
		b.Messages = make([]tokenizer.Message, len(f.Messages))
		fast := true
		for i, m := range f.Messages {
			if len(m.ToolCalls) > 0 && string(m.ToolCalls) != "null" {
				fast = false
				break
			}
			b.Messages[i] = tokenizer.Message{Role: m.Role, Name: m.Name, ToolCallID: m.ToolCallID, ReasoningContent: m.ReasoningContent, ContentNull: m.Content == nil}
			if m.Content != nil {
				b.Messages[i].Content = *m.Content
			}
		}
		if fast {
			return b, nil
		}
	}
	var b chatBody
	if err := json.Unmarshal(body, &b); err != nil {
		return b, fmt.Errorf("%w: chat body: %w", ErrTokenSource, err)
	}
	return b, nil
}

// promptTokens encodes a raw body's "prompt" (or "inputs") string, or
// returns its token ids.
func (s *ChatTokenSource) promptTokens(ctx context.Context, body []byte) ([]uint32, error) {
	var b struct {
		Prompt *Prompt          `json:"prompt"`
		Inputs *json.RawMessage `json:"inputs"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, fmt.Errorf("%w: body: %w", ErrTokenSource, err)
	}
	if b.Prompt == nil && b.Inputs != nil {
		b.Prompt = &Prompt{}
		if err := b.Prompt.UnmarshalJSON(*b.Inputs); err != nil {
			return nil, fmt.Errorf("%w: inputs: %w", ErrTokenSource, err)
		}
	}
	switch {
	case b.Prompt == nil:
		return nil, ErrNoTokens
	case len(b.Prompt.Tokens) > 0:
		return b.Prompt.Tokens[0], nil
	case len(b.Prompt.Texts) > 0:
		return s.text(ctx, b.Prompt.Texts[0], body)
	}
	return nil, ErrNoTokens
}
