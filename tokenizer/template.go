package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/ardanlabs/jinja"
)

// ErrTemplate wraps failures to compile or render a chat template (including the
// template's own raise_exception calls, e.g. "roles must alternate").
var ErrTemplate = errors.New("tokenizer: chat template")

// TemplateConfig is what a chat template reads besides the request.
type TemplateConfig struct {
	// BOSToken and EOSToken are tokenizer_config.json's bos_token and eos_token, exposed to
	// the template as bos_token and eos_token ("" when the model has none).
	BOSToken, EOSToken string
}

// JinjaTemplate is a compiled Hugging Face chat template, rendered with
// github.com/ardanlabs/jinja (chosen over gonja/v2: both render the Llama 3.1 and Qwen3
// vectors exactly, but this one has no dependencies, keeps dict insertion order for tojson,
// and is built for chat templates). Safe for concurrent use.
type JinjaTemplate struct {
	t   *jinja.Template
	cfg TemplateConfig
	// partsContent: the template iterates over message content, so content goes in as a
	// list of parts (vLLM's "openai" content format); otherwise as one string.
	partsContent bool
}

var _ ChatTemplate = (*JinjaTemplate)(nil)

// partsLoop detects templates that loop over a message's content, which is how vLLM's
// content-format detection decides between "string" and "openai" formats.
var partsLoop = regexp.MustCompile(`for\s+\w+\s+in\s+\w+(?:\[\s*-?\d+\s*\])*(?:\.content|\[\s*['"]content['"]\s*\])`)

// tojsonFilter finds uses of the tojson filter. ardanlabs/jinja's own tojson sorts keys
// when given indent= (it goes through a Go map), so such templates (Llama 3.1 with tools)
// would render differently from transformers; the filter is renamed to pyTojsonName, which
// the engine resolves from the render data when no built-in filter has that name.
var tojsonFilter = regexp.MustCompile(`\|\s*tojson\b`)

const pyTojsonName = "__kvrouter_tojson"

// NewJinjaTemplate compiles a chat template source.
func NewJinjaTemplate(src string, cfg TemplateConfig) (*JinjaTemplate, error) {
	src = tojsonFilter.ReplaceAllLiteralString(src, "| "+pyTojsonName)
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, fmt.Errorf("%w: compile: %w", ErrTemplate, err)
	}
	return &JinjaTemplate{t: t, cfg: cfg, partsContent: partsLoop.MatchString(src)}, nil
}

// Render implements ChatTemplate. The template sees messages, add_generation_prompt,
// bos_token, eos_token, tools and documents (none when not given), opts.Vars (winning over
// tools, bos_token and eos_token, not over add_generation_prompt nor documents given), and
// strftime_now on opts.Now.
func (j *JinjaTemplate) Render(msgs []Message, opts RenderOptions) (string, error) {
	for _, k := range []string{"messages", "chat_template", "tokenize"} {
		if _, ok := opts.Vars[k]; ok {
			// transformers already passes messages (a duplicate keyword), and vLLM
			// refuses the other two in chat_template_kwargs: the request is a 400.
			return "", fmt.Errorf("%w: chat_template_kwargs may not set %q", ErrBadMessage, k)
		}
	}
	data := make(map[string]jinja.Value, 8+len(opts.Vars))
	list := make([]jinja.Value, len(msgs))
	for i := range msgs {
		v, err := j.messageValue(&msgs[i])
		if err != nil {
			return "", err
		}
		list[i] = v
	}
	data["messages"] = jinja.NewList(list)
	data["bos_token"] = jinja.NewString(j.cfg.BOSToken)
	data["eos_token"] = jinja.NewString(j.cfg.EOSToken)
	// transformers renders with tools= and documents= always (none when the request has
	// none; chat_template_utils render_jinja_template), and vLLM passes "tools": [] on as
	// [] (serving_engine _preprocess_chat: tool_dicts), so both are always defined.
	data["tools"], data["documents"] = jinja.None(), jinja.None()
	if isJSON(opts.Tools) {
		tools, err := toolsValue(opts.Tools)
		if err != nil {
			return "", fmt.Errorf("%w: tools: %w", ErrBadMessage, err)
		}
		data["tools"] = tools
	}
	// The request's chat_template_kwargs win over tools (vLLM main adds tool_dicts
	// under them: with_defaults) and over bos_token/eos_token (transformers renders
	// with {**special_tokens_map, **kwargs}), but lose to the request's own
	// add_generation_prompt (true when absent) and documents when sent: vLLM main
	// merges merge_kwargs(chat_template_kwargs, {add_generation_prompt,
	// continue_final_message, documents, reasoning_effort}), the second winning
	// unless None (ChatCompletionRequest.build_chat_params,
	// vllm/entrypoints/openai/chat_completion/protocol.py @ 002032ee; merge_kwargs,
	// vllm/renderers/params.py).
	for k, v := range opts.Vars {
		data[k] = jinja.FromGoValue(v)
	}
	data["add_generation_prompt"] = jinja.NewBool(opts.AddGenerationPrompt)
	if isJSON(opts.Documents) {
		docs, err := jsonValue(opts.Documents)
		if err != nil {
			return "", fmt.Errorf("%w: documents: %w", ErrBadMessage, err)
		}
		data["documents"] = docs
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	data["strftime_now"] = jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
		if len(args) == 0 || !args[0].IsString() {
			return jinja.Undefined(), fmt.Errorf("strftime_now: want a format string")
		}
		return jinja.NewString(strftime(now(), args[0].AsString())), nil
	})
	data[pyTojsonName] = pyTojson
	out, err := j.t.RenderValues(data)
	if err != nil {
		return "", fmt.Errorf("%w: render: %w", ErrTemplate, err)
	}
	if opts.ContinueFinalMessage && len(list) > 0 {
		content, _ := list[len(list)-1].AsDict().Get("content")
		return continueFinal(out, content)
	}
	return out, nil
}

// continueFinal cuts out after the last occurrence of the final message's stripped
// text, as transformers' apply_chat_template does with continue_final_message
// (tokenization_utils_base.py): the text is the content the template got (vLLM's, so a
// tool message's joined texts), or for a list of parts the last part that has a text;
// none, or a text the render does not contain, fails (a 400 from vLLM).
func continueFinal(out string, content jinja.Value) (string, error) {
	final, ok := "", false
	switch {
	case content.IsString():
		final, ok = content.AsString(), true
	case content.IsList():
		l := content.AsList()
		for i := l.Len() - 1; i >= 0 && !ok; i-- {
			if p := l.Get(i); p.IsDict() {
				if t, has := p.AsDict().Get("text"); has && t.IsString() {
					final, ok = t.AsString(), true
				}
			}
		}
	}
	final = strings.TrimFunc(final, pyIsSpace)
	at := strings.LastIndex(out, final)
	if !ok || at < 0 {
		return "", fmt.Errorf("%w: continue_final_message: no text of the final message in the rendered chat", ErrTemplate)
	}
	return out[:at+len(final)], nil
}

// pyIsSpace is Python's str.isspace for one character, what str.strip() removes:
// unicode.IsSpace and the separators \x1c-\x1f (bidirectional class B or S).
func pyIsSpace(r rune) bool {
	return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f)
}

// isJSON reports a raw member that is present and not null.
func isJSON(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && string(raw) != "null"
}

// messageValue builds the dict a template sees for one message, with keys in the order
// an OpenAI request carries them; optional keys are absent (not none) when unset, so
// `is defined` tests behave as with vLLM.
func (j *JinjaTemplate) messageValue(m *Message) (jinja.Value, error) {
	v := jinja.NewDict()
	d := v.AsDict()
	d.Set("role", jinja.NewString(m.Role))
	content, err := j.contentValue(m)
	if err != nil {
		return jinja.Value{}, err
	}
	d.Set("content", content)
	if m.Name != "" || m.NameSet {
		d.Set("name", jinja.NewString(m.Name))
	}
	if r, ok := m.reasoning(); ok {
		d.Set("reasoning", jinja.NewString(r))
		d.Set("reasoning_content", jinja.NewString(r))
	}
	// vLLM keeps tool_calls only on assistant messages (_parse_chat_message_content).
	if len(m.ToolCalls) > 0 && m.Role == "assistant" {
		calls := make([]jinja.Value, len(m.ToolCalls))
		for i, tc := range m.ToolCalls {
			c := jinja.NewDict()
			cd := c.AsDict()
			if tc.ID != "" {
				cd.Set("id", jinja.NewString(tc.ID))
			}
			typ := tc.Type
			if typ == "" {
				typ = "function"
			}
			if typ != "function" {
				// vLLM validates tool calls as function calls (type
				// Literal["function"]) and answers 400 for others.
				return jinja.Value{}, fmt.Errorf("%w: tool call of type %q: vLLM takes function calls only", ErrBadMessage, typ)
			}
			cd.Set("type", jinja.NewString(typ))
			fn := jinja.NewDict()
			fd := fn.AsDict()
			fd.Set("name", jinja.NewString(tc.Function.Name))
			args, err := toolArguments(tc.Function.Arguments)
			if err != nil {
				return jinja.Value{}, fmt.Errorf("%w: tool call %q arguments: %w", ErrBadMessage, tc.Function.Name, err)
			}
			fd.Set("arguments", args)
			cd.Set("function", fn)
			calls[i] = c
		}
		d.Set("tool_calls", jinja.NewList(calls))
	}
	if m.ToolCallID != "" {
		d.Set("tool_call_id", jinja.NewString(m.ToolCallID))
	}
	if m.Role == "developer" {
		tools, err := developerTools(m)
		if err != nil {
			return jinja.Value{}, err
		}
		d.Set("tools", tools)
	}
	return v, nil
}

// developerTools is the tools key vLLM gives a developer message
// (_parse_chat_message_content: message.get("tools", None), vllm-project/vllm
// vllm/entrypoints/chat_utils.py @ 001eadcf): none when absent or null, else
// the list as pydantic validates it into CustomChatCompletionMessageParam's
// list[ChatCompletionFunctionToolParam] — TypedDicts, which keep their
// declared keys present, in declared order (function{name, description,
// parameters, strict}, type), and drop any other. Tools that do not validate
// so make the message OpenAI's developer message instead (the union's other
// member that fits; it has no tools): none. With no content to fit that one
// either, vLLM answers 400 (ErrBadMessage).
func developerTools(m *Message) (jinja.Value, error) {
	if !isJSON(m.Tools) {
		return jinja.None(), nil
	}
	v, err := jsonValue(m.Tools)
	if err == nil {
		if tools, ok := functionTools(v); ok {
			return tools, nil
		}
	}
	if m.ContentNull {
		return jinja.Value{}, fmt.Errorf("%w: developer message: tools are not function tools, and no content", ErrBadMessage)
	}
	return jinja.None(), nil
}

// functionTools validates v as a list of ChatCompletionFunctionToolParam
// (openai-python types/chat: function Required[FunctionDefinition], type
// Required[Literal["function"]]; FunctionDefinition: name Required[str],
// description str, parameters dict, strict Optional[bool]) and rebuilds each
// as the TypedDict keeps it.
func functionTools(v jinja.Value) (jinja.Value, bool) {
	if !v.IsList() {
		return jinja.Value{}, false
	}
	l := v.AsList()
	out := make([]jinja.Value, l.Len())
	for i := range l.Len() {
		tool := l.Get(i)
		if !tool.IsDict() {
			return jinja.Value{}, false
		}
		td := tool.AsDict()
		typ, _ := td.Get("type")
		fn, _ := td.Get("function")
		if !typ.IsString() || typ.AsString() != "function" || !fn.IsDict() {
			return jinja.Value{}, false
		}
		fd := fn.AsDict()
		f := jinja.NewDict()
		for _, k := range []string{"name", "description", "parameters", "strict"} {
			x, ok := fd.Get(k)
			switch {
			case !ok && k == "name":
				return jinja.Value{}, false
			case !ok:
				continue
			case (k == "name" || k == "description") && !x.IsString(),
				k == "parameters" && !x.IsDict(),
				k == "strict" && !x.IsNone() && !x.IsBool():
				return jinja.Value{}, false
			}
			f.AsDict().Set(k, x)
		}
		t := jinja.NewDict()
		t.AsDict().Set("function", f)
		t.AsDict().Set("type", typ)
		out[i] = t
	}
	return jinja.NewList(out), true
}

// reasoning is the thinking text vLLM gives the template for m, and whether it gives
// any: an assistant message's reasoning when sent and not null (even ""), else its
// reasoning_content when not empty; nothing for other roles.
func (m *Message) reasoning() (string, bool) {
	if m.Role != "assistant" {
		return "", false
	}
	if m.ReasoningSet || m.Reasoning != "" {
		return m.Reasoning, true
	}
	return m.ReasoningContent, m.ReasoningContent != ""
}

// contentValue is m's content as vLLM hands it to the template
// (_parse_chat_message_content, vLLM main at be90fe16): null or absent content is no
// parts, so "" for a string template and [] for one that loops over parts (never none);
// in the parts ("openai") format a media part becomes {"type": <modality>} and a tool
// message whose parts are all text becomes their texts joined with "\n".
func (j *JinjaTemplate) contentValue(m *Message) (jinja.Value, error) {
	if !j.partsContent {
		for i := range m.Parts {
			if _, err := partValue(&m.Parts[i]); err != nil {
				return jinja.Value{}, err // vLLM refuses it in either format
			}
		}
		return jinja.NewString(m.Content), nil
	}
	var parts []jinja.Value
	switch {
	case m.Parts != nil:
		parts = make([]jinja.Value, 0, len(m.Parts))
		for i := range m.Parts {
			v, err := partValue(&m.Parts[i])
			if err != nil {
				return jinja.Value{}, err
			}
			parts = append(parts, v)
		}
	case !m.ContentNull:
		parts = []jinja.Value{textPart(m.Content)}
	}
	if m.Role == "tool" {
		texts := make([]string, 0, len(parts))
		for _, p := range parts {
			t, _ := p.AsDict().Get("type")
			if !t.IsString() || t.AsString() != "text" {
				return jinja.NewList(parts), nil
			}
			s, _ := p.AsDict().Get("text")
			texts = append(texts, s.AsString())
		}
		return jinja.NewString(strings.Join(texts, "\n")), nil
	}
	if parts == nil {
		parts = []jinja.Value{}
	}
	return jinja.NewList(parts), nil
}

// mediaModality maps a media part's type to the modality vLLM writes in its place
// (_parse_chat_message_content_part); mediaKeys does the same for a part without a
// type, by the first of these keys it has (_parse_chat_message_content_mm_part).
var (
	mediaModality = map[string]string{"image_url": "image", "input_image": "image", "image_pil": "image",
		"image_embeds": "image", "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
		"video_url": "video", "video_embeds": "video"}
	mediaKeys = []string{"image_url", "image_pil", "image_embeds", "audio_embeds", "audio_url", "input_audio", "video_url"}
)

// partValue is one content part as a parts template sees it: a text part, a media
// part's {"type": <modality>} with its extra keys, a tool_reference's {"type", "name"};
// a part vLLM does not know is refused as vLLM refuses it (400).
func partValue(p *ContentPart) (jinja.Value, error) {
	if p.Raw == nil {
		return textPart(p.Text), nil
	}
	typ := p.Type
	if typ == "" {
		for _, k := range mediaKeys {
			if v, ok := p.Raw[k]; ok && (k != "input_audio" || v != nil) {
				typ = k
				break
			}
		}
	}
	out := jinja.NewDict()
	od := out.AsDict()
	switch {
	case typ == "text":
		// a text part with extra keys: already in vLLM's shape
	case mediaModality[typ] != "":
		od.Set("type", jinja.NewString(mediaModality[typ]))
	case typ == "tool_reference":
		od.Set("type", jinja.NewString(typ))
		od.Set("name", jinja.FromGoValue(p.Raw["name"]))
		return out, nil
	default:
		return jinja.Value{}, fmt.Errorf("%w: content part of type %q: vLLM does not take it", ErrBadMessage, typ)
	}
	keys := p.keys
	if keys == nil { // a part built in Go rather than decoded: no order to keep
		keys = slices.Sorted(maps.Keys(p.Raw))
	}
	for _, k := range keys {
		if typ == "text" || !knownPartKeys[k] {
			od.Set(k, jinja.FromGoValue(p.Raw[k]))
		}
	}
	return out, nil
}

func textPart(s string) jinja.Value {
	p := jinja.NewDict()
	p.AsDict().Set("type", jinja.NewString("text"))
	p.AsDict().Set("text", jinja.NewString(s))
	return p
}

// toolArguments follows vLLM's chat_utils _postprocess_messages (the version with
// vllm/entrypoints/chat_utils/ as a package): arguments become a dict before rendering
// (templates such as Llama 3.1's call tojson on it, Qwen3's prints a string as is). A JSON
// string is parsed; one that is not valid JSON, or decodes to anything but an object,
// becomes {}, and so do null, "", an absent value and any non-object value.
func toolArguments(raw json.RawMessage) (jinja.Value, error) {
	if len(raw) == 0 {
		return jinja.NewDict(), nil
	}
	v, err := jsonValue(raw)
	if err != nil {
		return jinja.Value{}, err
	}
	if v.IsString() {
		if v, err = jsonValue([]byte(v.AsString())); err != nil {
			return jinja.NewDict(), nil
		}
	}
	if !v.IsDict() {
		return jinja.NewDict(), nil
	}
	return v, nil
}

// toolsValue decodes a request's tools as vLLM hands them to the template:
// [tool.model_dump() for tool in request.tools] (serving_chat.py), where a tool is
// ChatCompletionToolsParam{type="function", function: FunctionDefinition{name,
// description=None, parameters=None}} (vllm/entrypoints/openai protocol). model_dump
// writes the declared fields first, in declared order, absent ones as null, then the
// extra keys the request carried (OpenAIBaseModel allows extras) in their order; the
// parameters schema is a dict[str, Any] and keeps the client's order. A tool of another
// shape is passed as sent (vLLM rejects such a request).
func toolsValue(raw []byte) (jinja.Value, error) {
	v, err := jsonValue(raw)
	if err != nil || !v.IsList() {
		return v, err
	}
	l := v.AsList()
	out := make([]jinja.Value, l.Len())
	for i := range l.Len() {
		out[i] = l.Get(i)
		tool := out[i]
		if !tool.IsDict() {
			continue
		}
		fn, ok := tool.AsDict().Get("function")
		if !ok || !fn.IsDict() {
			continue
		}
		fd := dumpModel(fn.AsDict(), []string{"name", "description", "parameters"})
		td := dumpModel(tool.AsDict(), []string{"type", "function"})
		if t, _ := td.AsDict().Get("type"); t.IsNone() {
			td.AsDict().Set("type", jinja.NewString("function"))
		}
		td.AsDict().Set("function", fd)
		out[i] = td
	}
	return jinja.NewList(out), nil
}

// dumpModel rebuilds d as pydantic's model_dump writes a model with the declared fields
// (absent ones as None), then d's other keys in their order.
func dumpModel(d *jinja.Dict, declared []string) jinja.Value {
	out := jinja.NewDict()
	od := out.AsDict()
	for _, k := range declared {
		v, ok := d.Get(k)
		if !ok {
			v = jinja.None()
		}
		od.Set(k, v)
	}
	for _, k := range d.Keys {
		if !slices.Contains(declared, k) {
			v, _ := d.Get(k)
			od.Set(k, v)
		}
	}
	return out
}

// jsonValue decodes JSON into a template value, keeping object key order (Go maps would
// lose it, and tojson output — hence the tokens — depends on it).
func jsonValue(raw []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return jinja.Value{}, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return jinja.Value{}, errors.New("trailing data after JSON value")
	}
	return v, nil
}

// maxJSONDepth bounds nesting so hostile input cannot exhaust the stack.
const maxJSONDepth = 64

func decodeValue(dec *json.Decoder, depth int) (jinja.Value, error) {
	if depth > maxJSONDepth {
		return jinja.Value{}, errors.New("JSON nested too deeply")
	}
	tok, err := dec.Token()
	if err != nil {
		return jinja.Value{}, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '[':
			var items []jinja.Value
			for dec.More() {
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Value{}, err
				}
				items = append(items, v)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Value{}, err
			}
			if items == nil {
				items = []jinja.Value{}
			}
			return jinja.NewList(items), nil
		case '{':
			obj := jinja.NewDict()
			d := obj.AsDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return jinja.Value{}, err
				}
				k, _ := kt.(string)
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Value{}, err
				}
				d.Set(k, v)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Value{}, err
			}
			return obj, nil
		}
		return jinja.Value{}, fmt.Errorf("unexpected %v", t)
	case json.Number:
		return numberValue(t), nil
	default:
		return jinja.FromGoValue(tok), nil
	}
}

// bigIntPrefix names the callables that stand for integers beyond int64 (jinja values
// have no big integers): Python's json keeps them exact, and pyTojson writes their
// digits back verbatim. Printed other than through tojson they do not read as numbers.
const bigIntPrefix = "__kvrouter_int:"

// numberValue is a JSON number as Python's json.loads reads it: an int (of any size)
// when it has no fraction or exponent, else a float.
func numberValue(n json.Number) jinja.Value {
	s := string(n)
	if !strings.ContainsAny(s, ".eE") {
		if _, err := n.Int64(); err != nil {
			return jinja.NewCallable(bigIntPrefix+s, func([]jinja.Value, map[string]jinja.Value) (jinja.Value, error) {
				return jinja.Undefined(), errors.New("an integer is not callable")
			})
		}
	}
	return jinja.FromGoValue(n)
}

// strftime formats t with the Python strftime directives chat templates use (Llama 3.x
// writes "%d %b %Y"); unknown directives are kept verbatim.
func strftime(t time.Time, format string) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 == len(format) {
			b.WriteByte(c)
			continue
		}
		i++
		switch format[i] {
		case 'Y':
			fmt.Fprintf(&b, "%04d", t.Year())
		case 'y':
			fmt.Fprintf(&b, "%02d", t.Year()%100)
		case 'm':
			fmt.Fprintf(&b, "%02d", int(t.Month()))
		case 'd':
			fmt.Fprintf(&b, "%02d", t.Day())
		case 'e':
			fmt.Fprintf(&b, "%2d", t.Day())
		case 'H':
			fmt.Fprintf(&b, "%02d", t.Hour())
		case 'I':
			h := t.Hour() % 12
			if h == 0 {
				h = 12
			}
			fmt.Fprintf(&b, "%02d", h)
		case 'M':
			fmt.Fprintf(&b, "%02d", t.Minute())
		case 'S':
			fmt.Fprintf(&b, "%02d", t.Second())
		case 'p':
			b.WriteString(t.Format("PM"))
		case 'b', 'h':
			b.WriteString(t.Format("Jan"))
		case 'B':
			b.WriteString(t.Format("January"))
		case 'a':
			b.WriteString(t.Format("Mon"))
		case 'A':
			b.WriteString(t.Format("Monday"))
		case 'j':
			fmt.Fprintf(&b, "%03d", t.YearDay())
		case 'Z':
			b.WriteString(t.Format("MST"))
		case 'z':
			b.WriteString(t.Format("-0700"))
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			b.WriteByte(format[i])
		}
	}
	return b.String()
}

// pyTojson is the tojson filter as transformers defines it for chat templates:
// json.dumps(x, ensure_ascii=False, indent=indent, separators=separators) — keys in
// insertion order, no HTML escaping, Python's float repr, and with indent the
// (",", ": ") separators and one item per line.
var pyTojson = jinja.NewCallable(pyTojsonName, func(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), errors.New("tojson: missing value")
	}
	e := pyJSON{itemSep: ", ", keySep: ": ", indent: -1}
	if v, ok := kwargs["indent"]; ok && v.IsInt() {
		e.indent, e.itemSep = int(v.AsInt()), ","
	}
	if v, ok := kwargs["separators"]; ok && v.IsList() && v.AsList().Len() == 2 {
		a, b := v.AsList().Get(0), v.AsList().Get(1)
		if !a.IsString() || !b.IsString() {
			return jinja.Undefined(), errors.New("tojson: separators must be two strings")
		}
		e.itemSep, e.keySep = a.AsString(), b.AsString()
	}
	var sb strings.Builder
	if err := e.write(&sb, args[0], 0); err != nil {
		return jinja.Undefined(), err
	}
	return jinja.NewString(sb.String()), nil
})

type pyJSON struct {
	indent          int // < 0: single line
	itemSep, keySep string
}

func (e pyJSON) newline(sb *strings.Builder, level int) {
	if e.indent < 0 {
		return
	}
	sb.WriteByte('\n')
	sb.WriteString(strings.Repeat(" ", e.indent*level))
}

func (e pyJSON) write(sb *strings.Builder, v jinja.Value, level int) error {
	if level > maxJSONDepth {
		return errors.New("tojson: value nested too deeply")
	}
	switch {
	case v.IsNone(), v.IsUndefined():
		sb.WriteString("null")
	case v.IsBool():
		sb.WriteString(strconv.FormatBool(v.AsBool()))
	case v.IsInt():
		sb.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		sb.WriteString(pyFloat(v.AsFloat()))
	case v.IsString():
		pyString(sb, v.AsString())
	case v.IsCallable() && strings.HasPrefix(v.AsCallable().Name, bigIntPrefix):
		sb.WriteString(strings.TrimPrefix(v.AsCallable().Name, bigIntPrefix))
	case v.IsList():
		l := v.AsList()
		if l.Len() == 0 {
			sb.WriteString("[]")
			return nil
		}
		sb.WriteByte('[')
		for i := range l.Len() {
			if i > 0 {
				sb.WriteString(e.itemSep)
			}
			e.newline(sb, level+1)
			if err := e.write(sb, l.Get(i), level+1); err != nil {
				return err
			}
		}
		e.newline(sb, level)
		sb.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		if d.Len() == 0 {
			sb.WriteString("{}")
			return nil
		}
		sb.WriteByte('{')
		for i, k := range d.Keys {
			if i > 0 {
				sb.WriteString(e.itemSep)
			}
			e.newline(sb, level+1)
			pyString(sb, k)
			sb.WriteString(e.keySep)
			val, _ := d.Get(k)
			if err := e.write(sb, val, level+1); err != nil {
				return err
			}
		}
		e.newline(sb, level)
		sb.WriteByte('}')
	default:
		return fmt.Errorf("tojson: cannot serialise %s", v.String())
	}
	return nil
}

// pyString writes s as Python's json.dumps(ensure_ascii=False) does: only the quote, the
// backslash and control characters are escaped.
func pyString(sb *strings.Builder, s string) {
	const hex = "0123456789abcdef"
	sb.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			sb.WriteString(`\"`)
		case '\\':
			sb.WriteString(`\\`)
		case '\n':
			sb.WriteString(`\n`)
		case '\r':
			sb.WriteString(`\r`)
		case '\t':
			sb.WriteString(`\t`)
		case '\b':
			sb.WriteString(`\b`)
		case '\f':
			sb.WriteString(`\f`)
		default:
			if c < 0x20 {
				sb.WriteString(`\u00`)
				sb.WriteByte(hex[c>>4])
				sb.WriteByte(hex[c&0xF])
			} else {
				sb.WriteByte(c)
			}
		}
	}
	sb.WriteByte('"')
}

// pyFloat formats f as Python's float repr: shortest round-trip digits, positional
// notation for exponents -4..15 with at least one decimal ("2.0"), scientific otherwise.
func pyFloat(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	sci := strconv.FormatFloat(f, 'e', -1, 64)
	exp, _ := strconv.Atoi(sci[strings.IndexByte(sci, 'e')+1:])
	if exp < -4 || exp >= 16 {
		return sci
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}
