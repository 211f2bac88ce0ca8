package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"

	"github.com/kvrouter/kvrouter/tokenizer"
)

const tokenizeUsage = `usage: kvctl tokenize (--model-dir DIR | --remote URL | --simple) [--check] [FILE|-]

Reads JSON lines shaped like the reference vectors — {"text": ..., "add_special_tokens":
bool} or {"messages": [...], "add_generation_prompt": bool, "tools": [...],
"chat_template_kwargs": {...}} — and writes each line back with "ids" (and "rendered" for
chats, except with --remote), so the router's tokenization can be checked against the
engine's. Text is encoded with add_special_tokens=false unless the line says true (vLLM
uses true for /v1/completions prompts: Llama 3 then starts with its BOS); chats are
rendered and encoded without, and add_generation_prompt defaults to true, as in vLLM. With
--check, lines that already carry "ids" (and "rendered") are compared: each output line
gets "match", and kvctl fails if any line differs.
`

// runTokenize implements `kvctl tokenize`.
func runTokenize(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("tokenize", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	modelDir := fs.String("model-dir", "", "directory with tokenizer.json (or .gz) and tokenizer_config.json")
	remote := fs.String("remote", "", "vLLM base URL: tokenize through its /tokenize endpoint instead")
	simple := fs.Bool("simple", false, "use the llm-d-inference-sim dummy tokenizer (no model files)")
	model := fs.String("model", "", "model name sent to --remote")
	check := fs.Bool("check", false, "compare with the ids/rendered already in each line")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, tokenizeUsage)
			return flag.ErrHelp
		}
		return fmt.Errorf("%w: %w\n%s", errUsage, err, tokenizeUsage)
	}
	sources := 0
	for _, set := range []bool{*modelDir != "", *remote != "", *simple} {
		if set {
			sources++
		}
	}
	if sources != 1 || fs.NArg() > 1 {
		return fmt.Errorf("%w: give exactly one of --model-dir, --remote, --simple and at most one FILE\n%s", errUsage, tokenizeUsage)
	}

	var src tokenSource
	switch {
	case *modelDir != "":
		hf, err := tokenizer.LoadHF(*modelDir, tokenizer.HFConfig{})
		if err != nil {
			return err
		}
		src = localSource(hf)
	case *simple:
		src = localSource(tokenizer.Simple{})
	default:
		r, err := tokenizer.NewRemote(tokenizer.RemoteConfig{URL: *remote, Model: *model})
		if err != nil {
			return fmt.Errorf("%w: %w", errUsage, err)
		}
		src = tokenSource{chat: r, text: r.EncodeText}
	}

	in := io.Reader(os.Stdin)
	if name := fs.Arg(0); name != "" && name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		defer f.Close()
		in = f
	}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 0, 1<<20), maxInput)
	w := bufio.NewWriter(stdout)
	defer w.Flush()
	lines, differ := 0, 0
	for sc.Scan() {
		if err := ctx.Err(); err != nil {
			return err
		}
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		lines++
		out, match, err := tokenizeLine(ctx, line, src, *check)
		if err != nil {
			return fmt.Errorf("line %d: %w", lines, err)
		}
		if !match {
			differ++
		}
		w.Write(out)
		w.WriteByte('\n')
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read input: %w", err)
	}
	if differ > 0 {
		return fmt.Errorf("%d of %d lines differ from their reference ids", differ, lines)
	}
	return nil
}

// tokenSource is what kvctl tokenize needs from a tokenizer.
type tokenSource struct {
	chat tokenizer.PromptTokenizer
	// text encodes plain text, with or without the model's special tokens.
	text func(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error)
	// renderer is nil for --remote: the engine renders and returns only ids.
	renderer tokenizer.ChatTemplate
}

// localTokenizer is what Simple and HF both offer.
type localTokenizer interface {
	tokenizer.ChatTokenizer
	tokenizer.SpecialEncoder
}

func localSource(t localTokenizer) tokenSource {
	return tokenSource{
		chat:     tokenizer.Local(t),
		renderer: t,
		text: func(_ context.Context, text string, special bool) ([]uint32, error) {
			if special {
				return t.EncodeSpecial(text)
			}
			return t.Encode(text)
		},
	}
}

// tokenizeLine tokenizes one input object and returns it with "ids" (and "rendered")
// set, keeping its other fields in their order. match is false only under check when
// the line's own ids or rendered text differ.
func tokenizeLine(ctx context.Context, line []byte, src tokenSource, check bool) ([]byte, bool, error) {
	renderer := src.renderer
	keys, vals, err := orderedObject(line)
	if err != nil {
		return nil, false, err
	}
	field := func(k string) json.RawMessage {
		if i := slices.Index(keys, k); i >= 0 {
			return vals[i]
		}
		return nil
	}
	set := func(k string, v any) error {
		// No HTML escaping: rendered prompts are full of "<|...|>" and must stay readable.
		var buf bytes.Buffer
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(v); err != nil {
			return err
		}
		b := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
		if i := slices.Index(keys, k); i >= 0 {
			vals[i] = b
		} else {
			keys, vals = append(keys, k), append(vals, b)
		}
		return nil
	}

	var ids []uint32
	rendered, isChat := "", false
	switch {
	case field("text") != nil:
		var text string
		if err := json.Unmarshal(field("text"), &text); err != nil {
			return nil, false, fmt.Errorf("\"text\" must be a string: %w", err)
		}
		special := false
		if raw := field("add_special_tokens"); raw != nil {
			if err := json.Unmarshal(raw, &special); err != nil {
				return nil, false, fmt.Errorf("\"add_special_tokens\" must be a boolean: %w", err)
			}
		}
		if ids, err = src.text(ctx, text, special); err != nil {
			return nil, false, err
		}
	case field("messages") != nil:
		isChat = true
		var msgs []tokenizer.Message
		if err := json.Unmarshal(field("messages"), &msgs); err != nil {
			return nil, false, fmt.Errorf("\"messages\": %w", err)
		}
		opts := tokenizer.RenderOptions{AddGenerationPrompt: true, Tools: field("tools")}
		if raw := field("add_generation_prompt"); raw != nil {
			if err := json.Unmarshal(raw, &opts.AddGenerationPrompt); err != nil {
				return nil, false, fmt.Errorf("\"add_generation_prompt\" must be a boolean: %w", err)
			}
		}
		if raw := field("chat_template_kwargs"); raw != nil {
			if err := json.Unmarshal(raw, &opts.Vars); err != nil {
				return nil, false, fmt.Errorf("\"chat_template_kwargs\" must be an object: %w", err)
			}
		}
		if renderer != nil {
			if rendered, err = renderer.Render(msgs, opts); err != nil {
				return nil, false, err
			}
		}
		if ids, err = src.chat.TokenizeChat(ctx, msgs, opts); err != nil {
			return nil, false, err
		}
	default:
		return nil, false, errors.New(`want an object with "text" or "messages"`)
	}

	match := true
	if check {
		if raw := field("ids"); raw != nil {
			var want []uint32
			if err := json.Unmarshal(raw, &want); err != nil {
				return nil, false, fmt.Errorf("\"ids\": %w", err)
			}
			match = slices.Equal(ids, want)
		}
		if raw := field("rendered"); raw != nil && isChat && renderer != nil {
			var want string
			if err := json.Unmarshal(raw, &want); err != nil {
				return nil, false, fmt.Errorf("\"rendered\": %w", err)
			}
			match = match && rendered == want
		}
	}
	if isChat && renderer != nil {
		if err := set("rendered", rendered); err != nil {
			return nil, false, err
		}
	}
	if ids == nil {
		ids = []uint32{}
	}
	if err := set("ids", ids); err != nil {
		return nil, false, err
	}
	if check {
		if err := set("match", match); err != nil {
			return nil, false, err
		}
	}
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range keys {
		if i > 0 {
			b.WriteByte(',')
		}
		kb, _ := json.Marshal(k)
		b.Write(kb)
		b.WriteByte(':')
		b.Write(vals[i])
	}
	b.WriteByte('}')
	return b.Bytes(), match, nil
}

// orderedObject splits a JSON object into its keys and raw values, in order.
func orderedObject(line []byte) ([]string, []json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(line))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, nil, errors.New("want a JSON object")
	}
	var keys []string
	var vals []json.RawMessage
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, nil, fmt.Errorf("bad JSON: %w", err)
		}
		k, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, fmt.Errorf("bad JSON: %w", err)
		}
		if i := slices.Index(keys, k); i >= 0 { // duplicate key: the last wins, as in encoding/json
			vals[i] = v
			continue
		}
		keys, vals = append(keys, k), append(vals, v)
	}
	if _, err := dec.Token(); err != nil {
		return nil, nil, fmt.Errorf("bad JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, nil, errors.New("trailing data after the object")
	}
	return keys, vals, nil
}
