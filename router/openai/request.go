package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Request is the part of an OpenAI chat or completions body the router
// reads. The body is forwarded as received, never re-serialised.
//
// The fields the token source and kv_aware's block keys need beyond
// routing are kept as the raw bytes of their values (nil when absent), so
// that the body is decoded once (jsonscan.go) and a value of the wrong type
// fails tokenization, as before, rather than the request.
type Request struct {
	Model          string        `json:"model"`
	Messages       []ChatMessage `json:"messages"`
	Prompt         *Prompt       `json:"prompt"`
	Stream         bool          `json:"stream"`
	PromptCacheKey string        `json:"prompt_cache_key"`

	// vLLM's extra fields: per-request KV isolation, chat rendering and
	// completions encoding.
	CacheSalt            json.RawMessage `json:"cache_salt"`
	AddGenerationPrompt  json.RawMessage `json:"add_generation_prompt"`
	ContinueFinalMessage json.RawMessage `json:"continue_final_message"`
	AddSpecialTokens     json.RawMessage `json:"add_special_tokens"`
	Tools                json.RawMessage `json:"tools"`
	Documents            json.RawMessage `json:"documents"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	// Flow control reads vLLM's request priority and the output bound.
	Priority            json.RawMessage `json:"priority"`
	MaxTokens           json.RawMessage `json:"max_tokens"`
	MaxCompletionTokens json.RawMessage `json:"max_completion_tokens"`
	// TruncatePromptTokens is vLLM's left truncation of the prompt
	// (router.PromptTruncation).
	TruncatePromptTokens json.RawMessage `json:"truncate_prompt_tokens"`
	// TruncationSide is vLLM main's side of that truncation ("left" keeps
	// the last tokens, "right" the first; router.PromptTruncationSide).
	TruncationSide json.RawMessage `json:"truncation_side"`
	// N and BestOf ask for several sequences of one prompt (disaggregation
	// serves those aggregated).
	N      json.RawMessage `json:"n"`
	BestOf json.RawMessage `json:"best_of"`
	// KVTransferParams is vLLM's disaggregated-serving member, which the
	// HTTP data plane strips from a client's body (router/httpapi/disagg.go).
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	// VLLMXargs is vLLM's vllm_xargs, copied into the engine request's
	// extra_args, where it reads kv_transfer_params from as well
	// (router.stripTransferParams).
	VLLMXargs json.RawMessage `json:"vllm_xargs"`

	// src is the body Parse decoded: kv_aware trusts CacheSalt only
	// for a Request whose Body is still these bytes (salt.go rewrites it).
	src []byte
}

// ChatMessage is one chat message; Content holds the text of a string
// content or of the text-like parts of an array content, in order. The other
// fields are raw values, for rendering the chat template.
type ChatMessage struct {
	Role             string          `json:"role"`
	Content          MessageContent  `json:"content"`
	Name             json.RawMessage `json:"name"`
	ToolCallID       json.RawMessage `json:"tool_call_id"`
	Reasoning        json.RawMessage `json:"reasoning"`
	ReasoningContent json.RawMessage `json:"reasoning_content"`
	ToolCalls        json.RawMessage `json:"tool_calls"`
	// Tools is a developer message's own tools (vLLM gives the template
	// them, or None, on every developer message: tokenizer.Message.Tools).
	Tools json.RawMessage `json:"tools"`
}

// MessageContent is the text of a message's content.
type MessageContent struct {
	Parts []string
	// Array: the content was a list of parts (Parts then holds only their
	// texts; rendering needs the parts themselves: a full decode).
	Array bool
	// Media: a part was not text (an image, audio, video or file): the
	// engine hashes the blocks its placeholder tokens fill from the media
	// too, so the prompt's token ids alone do not stand for it.
	Media bool
}

// UnmarshalJSON accepts a string, null, or an array of content parts (only
// text-like parts contribute, see partText; images and audio do not route).
func (m *MessageContent) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case len(b) == 0 || string(b) == "null":
		m.Parts, m.Array, m.Media = nil, false, false
		return nil
	case b[0] == '"':
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		m.Parts, m.Array, m.Media = []string{s}, false, false
		return nil
	case b[0] == '[':
		var parts []json.RawMessage
		if err := json.Unmarshal(b, &parts); err != nil {
			return err
		}
		m.Parts = m.Parts[:0]
		m.Array, m.Media = true, false
		for _, raw := range parts {
			text, isText, err := partText(raw)
			switch {
			case err != nil:
				return err
			case !isText:
				m.Media = true
			case text != nil:
				m.Parts = append(m.Parts, *text)
			}
		}
		return nil
	}
	return fmt.Errorf("content: want a string or an array of parts")
}

// partText reads one content part as vLLM's _parse_chat_message_content_part does: a
// bare string, and the text, input_text, output_text, refusal and thinking parts (their
// "text", "refusal" or "thinking") are text (nil when null); anything else is media.
func partText(raw json.RawMessage) (text *string, isText bool, err error) {
	var p struct {
		Type     string  `json:"type"`
		Text     *string `json:"text"`
		Refusal  *string `json:"refusal"`
		Thinking *string `json:"thinking"`
	}
	if raw = bytes.TrimSpace(raw); len(raw) > 0 && raw[0] == '"' {
		var s string
		err := json.Unmarshal(raw, &s)
		return &s, true, err
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, false, err
	}
	switch p.Type {
	case "text", "input_text", "output_text":
		return p.Text, true, nil
	case "refusal":
		return p.Refusal, true, nil
	case "thinking":
		return p.Thinking, true, nil
	}
	return nil, false, nil
}

// Prompt is a completions prompt: a string, a list of strings, a token-id
// array, or a list of token-id arrays.
type Prompt struct {
	Texts  []string
	Tokens [][]uint32
}

// UnmarshalJSON decodes every OpenAI prompt shape; token ids must fit
// uint32. It reads as Decode does (lists.go: each slice built at its size),
// without limits.
func (p *Prompt) UnmarshalJSON(b []byte) error {
	s := &jscan{b: b}
	q, err := s.prompt(1)
	if err != nil {
		return err
	}
	if s.peek() != 0 || s.i < len(s.b) {
		return s.errorf("invalid character after the prompt")
	}
	if q != nil { // null leaves p as it is, as encoding/json does
		*p = *q
	}
	return nil
}

// Sequences reports whether the request asks for more than one sequence:
// several prompts, or n or best_of above 1 (a value that is not a number
// counts as 1: the engine refuses it).
func (r *Request) Sequences() bool {
	if p := r.Prompt; p != nil && (len(p.Texts) > 1 || len(p.Tokens) > 1) {
		return true
	}
	for _, v := range []json.RawMessage{r.N, r.BestOf} {
		if f, err := strconv.ParseFloat(string(v), 64); err == nil && f > 1 {
			return true
		}
	}
	return false
}

// Kind is the OpenAI endpoint a body was posted to: it decides what the
// body must carry.
type Kind uint8

// Kinds.
const (
	// Any checks only that the body is valid JSON of the shape read here.
	Any Kind = iota
	// Chat is POST /v1/chat/completions: messages are required.
	Chat
	// Completions is POST /v1/completions: a prompt is required.
	Completions
)

// Parse decodes an OpenAI chat or completions body (validating all of it,
// see jsonscan.go) within lim and checks that it carries what the endpoint
// needs. Its errors' text is the client-facing message of a 400; a body
// over a limit fails with a *LimitError.
func Parse(kind Kind, body []byte, lim Limits) (*Request, error) {
	var r Request
	if err := Decode(body, &r, lim); err != nil {
		if le := (*LimitError)(nil); errors.As(err, &le) {
			return nil, le
		}
		return nil, fmt.Errorf("malformed JSON body: %v", err)
	}
	r.src = body
	switch kind {
	case Chat:
		if len(r.Messages) == 0 {
			return nil, errors.New("messages: required, at least one message")
		}
	case Completions:
		if r.Prompt == nil || (len(r.Prompt.Texts) == 0 && len(r.Prompt.Tokens) == 0) {
			return nil, errors.New("prompt: required")
		}
	}
	return &r, nil
}

// Source is the body Parse decoded (kv_aware trusts CacheSalt only for a
// request whose body is still these bytes).
func (r *Request) Source() []byte { return r.src }

// HasMedia reports whether a message has a content part without text (an
// image, audio, video or file; MessageContent.Media).
func (r *Request) HasMedia() bool {
	for i := range r.Messages {
		if r.Messages[i].Content.Media {
			return true
		}
	}
	return false
}

// textBuilder collects at most limit characters (runes) of text.
type textBuilder struct {
	sb    strings.Builder
	left  int
	began bool
}

func newTextBuilder(limit int) *textBuilder {
	tb := &textBuilder{left: limit}
	return tb
}

func (t *textBuilder) full() bool { return t.left <= 0 }

// add appends s (after a "\n" separator from earlier pieces), cut at the limit.
func (t *textBuilder) add(s string) {
	if t.began {
		t.put("\n")
	}
	t.began = true
	t.put(s)
}

func (t *textBuilder) put(s string) {
	if t.left <= 0 {
		return
	}
	if len(s) <= t.left { // runes <= bytes: it all fits
		t.sb.WriteString(s)
		t.left -= utf8.RuneCountInString(s)
		return
	}
	// ASCII runs are one rune per byte: skip them without decoding.
	i := 0
	for i < t.left && s[i] < utf8.RuneSelf {
		i++
	}
	n := i
	for i < len(s) && n < t.left {
		_, size := utf8.DecodeRuneInString(s[i:])
		i += size
		n++
	}
	t.sb.WriteString(s[:i])
	t.left -= n
}

// RoutingText is the routing text of an OpenAI request: the first
// limit characters of the messages' text (or the prompt), in order, pieces
// joined by "\n". A token-id prompt routes by its ids written in decimal,
// space separated.
func RoutingText(r *Request, limit int) string { return RoutingTextKeep(r, limit, 0) }

// RoutingTextKeep is RoutingText of a request whose engine prefills only
// the last keep tokens of each token-id prompt (vLLM's
// truncate_prompt_tokens: prompt_ids[-keep:] in
// OpenAIServing._normalize_prompt_tokens_to_input, vLLM v0.11): those ids
// route, as they are what the engine caches. keep 0 is the whole prompt.
// Text prompts and messages route from their start whatever keep is: where
// the engine cuts them is known only in tokens (docs/kv-aware.md).
func RoutingTextKeep(r *Request, limit, keep int) string {
	tb := newTextBuilder(limit)
	for _, m := range r.Messages {
		for _, p := range m.Content.Parts {
			if tb.full() {
				return tb.sb.String()
			}
			tb.add(p)
		}
	}
	if r.Prompt != nil {
		for _, s := range r.Prompt.Texts {
			if tb.full() {
				break
			}
			tb.add(s)
		}
		var num [12]byte
		for _, ids := range r.Prompt.Tokens {
			if keep > 0 && len(ids) > keep {
				ids = ids[len(ids)-keep:]
			}
			for j, id := range ids {
				if tb.full() {
					return tb.sb.String()
				}
				if j == 0 {
					tb.add(string(strconv.AppendUint(num[:0], uint64(id), 10)))
				} else {
					tb.put(" ")
					tb.put(string(strconv.AppendUint(num[:0], uint64(id), 10)))
				}
			}
		}
	}
	return tb.sb.String()
}

// firstTokens is the token ids of a prompt's first sequence: a batch of
// token prompts is routed, as a whole, by its first member.
func FirstTokens(p *Prompt) []uint32 {
	if p == nil || len(p.Tokens) == 0 {
		return nil
	}
	return p.Tokens[0]
}
