// Package tokenizer turns a request into the token ids a model server will see: it renders
// chat messages through the model's chat template and encodes the result the way vLLM does
// (add_special_tokens=false, special tokens written in the text matched as specials).
//
// It is a leaf package (it imports nothing else from kvrouter) because three programs need
// the same answer from it: the router computes block keys from these ids, kvsim stores blocks
// under them, and kvctl lets an operator check a model's files against the engine. If the
// router and the engine disagree on a single token, every block key after it differs and
// exact cache-state routing silently degrades to guessing.
//
// Implementations: Simple (the llm-d-inference-sim dummy tokenizer; no model files), HF
// (a pure-Go loader of Hugging Face tokenizer.json + tokenizer_config.json: byte-level BPE
// and SentencePiece-style BPE, with a Jinja chat template) and Remote (a vLLM /tokenize
// endpoint behind an LRU cache).
package tokenizer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Tokenizer encodes text to token ids with add_special_tokens=false: no BOS/EOS is added,
// but special tokens written in the text (e.g. "<|eot_id|>") are matched as special tokens,
// as vLLM does for rendered chat prompts. Implementations are safe for concurrent use.
type Tokenizer interface {
	Encode(text string) ([]uint32, error)
}

// ChatTemplate renders chat messages into the prompt text the engine tokenizes.
// Implementations are safe for concurrent use.
type ChatTemplate interface {
	Render(msgs []Message, opts RenderOptions) (string, error)
}

// ChatTokenizer is what a request path needs from one model: plain text encoding for
// completions and template rendering for chats. Simple, HF and Remote implement it.
type ChatTokenizer interface {
	Tokenizer
	ChatTemplate
}

// EncodeChat renders msgs with t and encodes the result (with the special tokens when
// opts.AddSpecialTokens, which needs a SpecialEncoder); it returns the rendered prompt too.
func EncodeChat(t ChatTokenizer, msgs []Message, opts RenderOptions) ([]uint32, string, error) {
	text, err := t.Render(msgs, opts)
	if err != nil {
		return nil, "", err
	}
	ids, err := local{t}.encode(context.Background(), text, opts.AddSpecialTokens)
	if err != nil {
		return nil, text, err
	}
	return ids, text, nil
}

// RenderOptions are the per-request inputs of a chat template besides the messages.
// The zero value renders without a generation prompt, tools or extra variables.
type RenderOptions struct {
	// AddGenerationPrompt appends the assistant turn header (OpenAI chat requests: true by
	// default in vLLM; callers pass the request's add_generation_prompt).
	AddGenerationPrompt bool
	// Tools is the request's raw "tools" JSON array, passed to the template as `tools`
	// the way vLLM passes them (each tool as ChatCompletionToolsParam.model_dump(): type,
	// function{name, description, parameters}, absent ones null, extra keys after), with
	// the order of other keys kept (tojson output, hence tokens, depends on it). nil or
	// null gives the template tools = none and an empty array tools = [], as vLLM and
	// transformers do (tools is always defined).
	Tools json.RawMessage
	// Documents is the request's raw "documents" (vLLM's ChatCompletionRequest field for
	// RAG templates), given to the template as documents with key order kept; nil or
	// null gives documents = none.
	Documents json.RawMessage
	// ContinueFinalMessage ends the prompt where the final message's text does, as
	// transformers' apply_chat_template(continue_final_message=True) does for vLLM: the
	// render is cut after the last occurrence of that text, stripped (the final message's
	// string content, or its last text part). Simple ignores it.
	ContinueFinalMessage bool
	// Vars are extra template variables (vLLM's chat_template_kwargs, e.g. enable_thinking).
	// As in vLLM main they win over tools, bos_token and eos_token, and lose to
	// AddGenerationPrompt and to Documents when given; "messages", "chat_template" and
	// "tokenize" fail the render with ErrBadMessage (vLLM answers 400).
	Vars map[string]any
	// Now is the clock behind strftime_now; nil means time.Now.
	Now func() time.Time
	// AddSpecialTokens encodes the rendered prompt with add_special_tokens=true (vLLM's
	// chat request field of that name, false by default): the tokenizer's special tokens
	// (Llama 3's <|begin_of_text|>) on top of those the template writes. Templates do not
	// see it.
	AddSpecialTokens bool
}

// Message is one chat message as OpenAI-compatible requests carry it.
type Message struct {
	Role string `json:"role"`
	// Content is the message text. When the request sent content as a list of parts, Parts
	// holds them and Content is their text parts joined with "\n", which is what vLLM
	// passes to templates that take content as a string.
	Content string `json:"-"`
	// Parts is non-nil when content was a list of parts ({"type":"text","text":...}).
	Parts []ContentPart `json:"-"`
	// ContentNull records that content was JSON null or absent (assistant tool-call turns).
	ContentNull bool `json:"-"`

	Name string `json:"name,omitempty"`
	// NameSet records that name was sent as a string, even "": vLLM then gives it to the
	// template (_parse_chat_message_content: isinstance(message["name"], str)).
	NameSet    bool       `json:"-"`
	ToolCalls  []ToolCall `json:"tool_calls,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
	// Reasoning is the assistant's thinking text as current vLLM reads it
	// (_parse_chat_message_content: message.get("reasoning")), which gives the template
	// both reasoning and reasoning_content from it. ReasoningContent is the older field
	// (Qwen3 templates read reasoning_content): used when Reasoning is empty, as the vLLM
	// releases that read `reasoning or reasoning_content` do. Both count on assistant
	// messages only, and both are sent to the engine's /tokenize as given.
	Reasoning        string `json:"reasoning,omitempty"`
	ReasoningContent string `json:"reasoning_content,omitempty"`
	// ReasoningSet records that reasoning was sent and not null, even as "": vLLM then
	// gives the template reasoning (and reasoning_content) from it
	// (_parse_chat_message_content: `if reasoning is not None`).
	ReasoningSet bool `json:"-"`
	// Tools is a developer message's own "tools", raw as sent. vLLM gives every
	// developer message a tools key, these tools (as their TypedDict validates
	// them) or None (_parse_chat_message_content, vllm/entrypoints/chat_utils.py
	// @ 001eadcf); other roles' tools are dropped.
	Tools json.RawMessage `json:"tools,omitempty"`
}

// ContentPart is one element of a list-valued message content.
type ContentPart struct {
	Type string `json:"type"`
	Text string `json:"text,omitempty"`
	// Raw keeps the whole part so templates see non-text parts (images) unchanged.
	Raw map[string]any `json:"-"`
	// keys are Raw's keys in the order the request sent them (vLLM hands the template a
	// part's extra keys in that order).
	keys []string
}

// ToolCall is one assistant tool call. Arguments is kept as sent: OpenAI sends a JSON
// string; some clients send an object. Templates see an object, as vLLM gives them: the
// string's JSON object, else {} (null, "", invalid JSON, or JSON that is not an object).
type ToolCall struct {
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments,omitempty"`
	} `json:"function"`
}

// UnmarshalJSON reads a tool call by exact keys, as vLLM does (UnmarshalExact):
// "Function" is not its function.
func (c *ToolCall) UnmarshalJSON(b []byte) error {
	type plain ToolCall
	var aux struct {
		plain
		Function json.RawMessage `json:"function"`
	}
	if err := UnmarshalExact(b, &aux); err != nil {
		return err
	}
	*c = ToolCall(aux.plain)
	if len(aux.Function) > 0 {
		return UnmarshalExact(aux.Function, &c.Function)
	}
	return nil
}

// ErrBadMessage reports a chat message this package cannot interpret.
var ErrBadMessage = errors.New("tokenizer: bad message")

// UnmarshalJSON accepts content as a string, null, or a list of parts.
func (m *Message) UnmarshalJSON(b []byte) error {
	type plain Message
	var aux struct {
		plain
		Content   json.RawMessage `json:"content"`
		Reasoning *string         `json:"reasoning"`
		Name      *string         `json:"name"`
	}
	// Exact keys, as vLLM reads a message (UnmarshalExact).
	if err := UnmarshalExact(b, &aux); err != nil {
		return fmt.Errorf("%w: %w", ErrBadMessage, err)
	}
	*m = Message(aux.plain)
	if aux.Reasoning != nil {
		m.Reasoning, m.ReasoningSet = *aux.Reasoning, true
	}
	if aux.Name != nil {
		m.Name, m.NameSet = *aux.Name, true
	}
	c := bytes.TrimSpace(aux.Content)
	switch {
	case len(c) == 0 || bytes.Equal(c, []byte("null")):
		m.ContentNull = true
	case c[0] == '"':
		if err := json.Unmarshal(c, &m.Content); err != nil {
			return fmt.Errorf("%w: content: %w", ErrBadMessage, err)
		}
	case c[0] == '[':
		var raws []json.RawMessage
		if err := json.Unmarshal(c, &raws); err != nil {
			return fmt.Errorf("%w: content parts: %w", ErrBadMessage, err)
		}
		m.Parts = make([]ContentPart, 0, len(raws))
		var text bytes.Buffer
		for _, raw := range raws {
			p, keep, err := parsePart(raw)
			if err != nil {
				return err
			}
			if !keep {
				continue
			}
			// vLLM joins the non-empty texts (_parse_chat_message_content_parts keeps
			// only truthy results) with "\n"; a tool_reference's name is one of them
			// (_parse_chat_message_content_part returns it when not wrapping dicts).
			if s := p.stringFormatText(); s != "" {
				if text.Len() > 0 {
					text.WriteByte('\n')
				}
				text.WriteString(s)
			}
			m.Parts = append(m.Parts, p)
		}
		m.Content = text.String()
	default:
		return fmt.Errorf("%w: content must be a string, null or a list of parts", ErrBadMessage)
	}
	return nil
}

// stringFormatText is the text p adds to the message's content in vLLM's "string"
// content format: a text part's text, a tool_reference's name, nothing for media.
func (p *ContentPart) stringFormatText() string {
	switch p.Type {
	case "text":
		return p.Text
	case "tool_reference":
		name, _ := p.Raw["name"].(string)
		return name
	}
	return ""
}

// textPartKeys are, per text-like content part type, the key vLLM reads the text from
// (_parse_chat_message_content_part: TEXT_PART_TYPES and MM_PARSER_MAP).
var textPartKeys = map[string]string{"text": "text", "input_text": "text", "output_text": "text",
	"refusal": "refusal", "thinking": "thinking"}

// knownPartKeys are the keys some content-part type declares (vLLM's
// _KNOWN_CONTENT_PART_FIELDS, the fields of the ChatCompletionContentPartParam union in
// vllm/renderers/chat_utils, vLLM main at be90fe16): a part's other keys are "extra" and
// reach the template after the text or modality.
var knownPartKeys = map[string]bool{"type": true, "text": true, "image_url": true, "input_audio": true,
	"file": true, "audio_url": true, "video_url": true, "refusal": true, "image_pil": true, "uuid": true,
	"image_embeds": true, "audio_embeds": true, "video_embeds": true, "data": true, "name": true,
	"thinking": true, "closed": true}

// parsePart reads one element of a content list as vLLM does: a bare string or a
// text-like part is a text part ({"type":"text","text":...} plus the part's extra keys,
// which is what a template looping over content sees); one whose text is null is
// skipped (keep false); anything else (images, audio) is kept as sent.
func parsePart(raw json.RawMessage) (p ContentPart, keep bool, err error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 && raw[0] == '"' {
		if err := json.Unmarshal(raw, &p.Text); err != nil {
			return p, false, fmt.Errorf("%w: content part: %w", ErrBadMessage, err)
		}
		p.Type = "text"
		return p, true, nil
	}
	var r map[string]any
	if err := json.Unmarshal(raw, &r); err != nil || r == nil {
		return p, false, fmt.Errorf("%w: content part must be a string or an object", ErrBadMessage)
	}
	typ, _ := r["type"].(string)
	key, textLike := textPartKeys[typ]
	if !textLike {
		p.Type, p.Raw, p.keys = typ, r, objectKeys(raw)
		p.Text, _ = r["text"].(string)
		return p, true, nil
	}
	text, ok := r[key].(string)
	if !ok {
		return p, false, nil
	}
	p.Type, p.Text = "text", text
	extra := false
	for k := range r {
		if !knownPartKeys[k] {
			extra = true
		}
	}
	if extra {
		// vLLM's part: type text, the text, then the extra keys in their order.
		p.Raw = map[string]any{"type": "text", "text": text}
		p.keys = []string{"type", "text"}
		for _, k := range objectKeys(raw) {
			if !knownPartKeys[k] {
				p.Raw[k] = r[k]
				p.keys = append(p.keys, k)
			}
		}
	}
	return p, true, nil
}

// objectKeys are a JSON object's keys in their order, each once (the last value wins in
// encoding/json, as in Python's json; the first position is kept, as a dict keeps it).
func objectKeys(raw []byte) []string {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil
	}
	var keys []string
	seen := map[string]bool{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return keys
		}
		if k, ok := t.(string); ok && !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return keys
		}
	}
	return keys
}

// MarshalJSON writes content back in the shape it arrived in.
func (m Message) MarshalJSON() ([]byte, error) {
	type plain Message
	var content any = m.Content
	switch {
	case m.Parts != nil:
		parts := make([]any, len(m.Parts))
		for i, p := range m.Parts {
			if p.Raw != nil {
				parts[i] = p.Raw
			} else {
				parts[i] = map[string]any{"type": p.Type, "text": p.Text}
			}
		}
		content = parts
	case m.ContentNull:
		content = nil
	}
	// reasoning and name are sent even when "", as the request had them.
	var reasoning, name *string
	if m.ReasoningSet || m.Reasoning != "" {
		reasoning = &m.Reasoning
	}
	if m.NameSet || m.Name != "" {
		name = &m.Name
	}
	return json.Marshal(struct {
		plain
		Content   any     `json:"content"`
		Reasoning *string `json:"reasoning,omitempty"`
		Name      *string `json:"name,omitempty"`
	}{plain(m), content, reasoning, name})
}
