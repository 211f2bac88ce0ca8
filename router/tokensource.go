package router

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
		pre, suf, err := textAffixes(cfg.Path)
		if err != nil {
			return nil, fmt.Errorf("%w: load %s: %w", ErrTokenSource, cfg.Path, err)
		}
		return &ChatTokenSource{Tokenizer: tokenizer.Local(hf), TextPrefix: pre, TextSuffix: suf}, nil
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
// vLLM encodes a completions *text* prompt with add_special_tokens=true:
// TextPrefix and TextSuffix are the ids the model's post-processor adds
// around it (Llama 3: <|begin_of_text|>), read from tokenizer.json by the
// files source. The engine source cannot know them (its client tokenizes
// with add_special_tokens=false), so its completions text prompts of such
// models key one token short and route heuristically.
type ChatTokenSource struct {
	Tokenizer              tokenizer.PromptTokenizer
	TextPrefix, TextSuffix []uint32
}

// text tokenizes a completions text prompt as vLLM does.
func (s *ChatTokenSource) text(ctx context.Context, text string) ([]uint32, error) {
	ids, err := s.Tokenizer.TokenizeText(ctx, text)
	if err != nil || len(s.TextPrefix)+len(s.TextSuffix) == 0 {
		return ids, err
	}
	out := make([]uint32, 0, len(s.TextPrefix)+len(ids)+len(s.TextSuffix))
	out = append(append(append(out, s.TextPrefix...), ids...), s.TextSuffix...)
	return out, nil
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
			return s.text(ctx, req.Parsed.Prompt.Texts[0])
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
		return s.text(ctx, b.Prompt.Texts[0])
	}
	return nil, ErrNoTokens
}

// textAffixes returns the special-token ids a Hugging Face tokenizer adds
// around a single text when add_special_tokens is true — what vLLM does to a
// completions prompt (its CompletionRequest.add_special_tokens defaults to
// true; chat requests default to false). They come from tokenizer.json's
// post_processor: TemplateProcessing's "single" template (Llama 3:
// <|begin_of_text|> before the text), Bert/RobertaProcessing (cls before,
// sep after), a Sequence of processors; other kinds add nothing.
func textAffixes(dir string) (prefix, suffix []uint32, err error) {
	raw, err := readTokenizerJSON(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, nil, err
	}
	var f struct {
		PostProcessor json.RawMessage `json:"post_processor"`
	}
	if err := json.Unmarshal(raw, &f); err != nil {
		return nil, nil, fmt.Errorf("%w: tokenizer.json: %w", ErrTokenSource, err)
	}
	return postProcessorAffixes(f.PostProcessor, 0)
}

func postProcessorAffixes(raw json.RawMessage, depth int) (prefix, suffix []uint32, err error) {
	if len(raw) == 0 || string(raw) == "null" || depth > 8 {
		return nil, nil, nil
	}
	var pp struct {
		Type       string            `json:"type"`
		Processors []json.RawMessage `json:"processors"`
		Single     []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct{} `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []uint32 `json:"ids"`
		} `json:"special_tokens"`
		CLS []json.RawMessage `json:"cls"` // ["[CLS]", 101]
		SEP []json.RawMessage `json:"sep"`
	}
	if err := json.Unmarshal(raw, &pp); err != nil {
		return nil, nil, fmt.Errorf("%w: post_processor: %w", ErrTokenSource, err)
	}
	switch pp.Type {
	case "Sequence":
		for _, p := range pp.Processors {
			pre, suf, err := postProcessorAffixes(p, depth+1)
			if err != nil {
				return nil, nil, err
			}
			prefix, suffix = append(prefix, pre...), append(suf, suffix...)
		}
	case "TemplateProcessing":
		seen := false
		for _, it := range pp.Single {
			switch {
			case it.Sequence != nil:
				seen = true
			case it.SpecialToken != nil:
				st, ok := pp.SpecialTokens[it.SpecialToken.ID]
				if !ok {
					return nil, nil, fmt.Errorf("%w: post_processor: special token %q undefined", ErrTokenSource, it.SpecialToken.ID)
				}
				if seen {
					suffix = append(suffix, st.IDs...)
				} else {
					prefix = append(prefix, st.IDs...)
				}
			}
		}
	case "BertProcessing", "RobertaProcessing":
		id := func(pair []json.RawMessage) ([]uint32, error) {
			var v uint32
			if len(pair) != 2 || json.Unmarshal(pair[1], &v) != nil {
				return nil, fmt.Errorf("%w: post_processor %s: want [token, id]", ErrTokenSource, pp.Type)
			}
			return []uint32{v}, nil
		}
		if prefix, err = id(pp.CLS); err != nil {
			return nil, nil, err
		}
		if suffix, err = id(pp.SEP); err != nil {
			return nil, nil, err
		}
	}
	return prefix, suffix, nil
}

// readTokenizerJSON reads path, or path.gz (how the test data is kept).
func readTokenizerJSON(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		return b, nil
	}
	f, gzErr := os.Open(path + ".gz")
	if gzErr != nil {
		return nil, fmt.Errorf("%w: %w", ErrTokenSource, err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("%w: %s.gz: %w", ErrTokenSource, path, err)
	}
	b, err = io.ReadAll(io.LimitReader(zr, 1<<30))
	if err != nil {
		return nil, fmt.Errorf("%w: %s.gz: %w", ErrTokenSource, path, err)
	}
	return b, nil
}
