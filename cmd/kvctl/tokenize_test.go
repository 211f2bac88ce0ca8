package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/tokenizer"
)

const tokTestdata = "../../tokenizer/testdata"

// TestTokenizeChecksReferenceVectors: every line of both reference files passes --check,
// and each output line keeps its fields and carries the ids and rendered text.
func TestTokenizeChecksReferenceVectors(t *testing.T) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		dir := filepath.Join(tokTestdata, model)
		var out bytes.Buffer
		if err := runTokenize(context.Background(), []string{"--model-dir", dir, "--check", filepath.Join(dir, "vectors.jsonl")}, &out); err != nil {
			t.Fatalf("%s: %v", model, err)
		}
		sc := bufio.NewScanner(&out)
		sc.Buffer(nil, 1<<24)
		n := 0
		for sc.Scan() {
			n++
			var line struct {
				Text     *string  `json:"text"`
				Rendered *string  `json:"rendered"`
				IDs      []uint32 `json:"ids"`
				Match    *bool    `json:"match"`
			}
			if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
				t.Fatalf("%s line %d: %v", model, n, err)
			}
			if line.Match == nil || !*line.Match || (line.Text == nil && line.Rendered == nil) {
				t.Fatalf("%s line %d: %s", model, n, sc.Bytes())
			}
		}
		if n != 135 {
			t.Fatalf("%s: %d output lines, want 135", model, n)
		}
	}
}

// TestTokenizeOutput feeds one file through one model load (loading is the slow part).
func TestTokenizeOutput(t *testing.T) {
	lines := []struct{ in, want string }{
		{`{"text":"Hello, world!","x":1}`, `{"text":"Hello, world!","x":1,"ids":[9707,11,1879,0]}`},
		{`{"messages":[{"role":"user","content":"hi"}]}`, // add_generation_prompt defaults to true
			`{"messages":[{"role":"user","content":"hi"}],"rendered":"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n","ids":[151644,872,198,6023,151645,198,151644,77091,198]}`},
		{`{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}`,
			`{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false},"rendered":"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n","ids":[151644,872,198,6023,151645,198,151644,77091,198,151667,271,151668,271]}`},
		{`{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`,
			`{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false,"rendered":"<|im_start|>user\nhi<|im_end|>\n","ids":[151644,872,198,6023,151645,198]}`},
		{`{"text":""}`, `{"text":"","ids":[]}`},
		{`{"text":"Hello, world!","add_special_tokens":true}`, `{"text":"Hello, world!","add_special_tokens":true,"ids":[9707,11,1879,0]}`}, // Qwen3 adds no BOS
	}
	var in, want []string
	for _, l := range lines {
		in, want = append(in, l.in, ""), append(want, l.want)
	}
	f := filepath.Join(t.TempDir(), "in.jsonl")
	os.WriteFile(f, []byte(strings.Join(in, "\n")), 0o644)
	var out bytes.Buffer
	if err := runTokenize(context.Background(), []string{"--model-dir", filepath.Join(tokTestdata, "qwen3"), f}, &out); err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSpace(out.String()), "\n")
	if !slices.Equal(got, want) {
		t.Fatalf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// --check marks a differing line and fails the run.
	out.Reset()
	ids, _ := tokenizer.Simple{}.Encode("a")
	os.WriteFile(f, []byte(`{"text":"a","ids":[1]}`+"\n"+`{"text":"a","ids":[`+strconv.Itoa(int(ids[0]))+`]}`+"\n"), 0o644)
	err := runTokenize(context.Background(), []string{"--simple", "--check", f}, &out)
	if err == nil || !strings.Contains(err.Error(), "1 of 2 lines differ") {
		t.Fatalf("err = %v, want a difference reported", err)
	}
	if got := strings.Count(out.String(), `"match":false`); got != 1 || strings.Count(out.String(), `"match":true`) != 1 {
		t.Fatalf("output %s", out.String())
	}
}

func TestTokenizeSimpleAndRemote(t *testing.T) {
	// The engine side: vLLM's /tokenize shape served by the Simple tokenizer.
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Prompt   *string             `json:"prompt"`
			Messages []tokenizer.Message `json:"messages"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		var ids []uint32
		if req.Prompt != nil {
			ids, _ = tokenizer.Simple{}.Encode(*req.Prompt)
		} else {
			ids, _, _ = tokenizer.EncodeChat(tokenizer.Simple{}, req.Messages, tokenizer.RenderOptions{})
		}
		json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "max_model_len": 1024, "tokens": ids})
	}))
	defer ts.Close()
	in := `{"text":"hello, world"}` + "\n" + `{"messages":[{"role":"user","content":"hi"}]}` + "\n"
	f := filepath.Join(t.TempDir(), "in.jsonl")
	os.WriteFile(f, []byte(in), 0o644)
	var simple, remote bytes.Buffer
	if err := runTokenize(context.Background(), []string{"--simple", f}, &simple); err != nil {
		t.Fatal(err)
	}
	if err := runTokenize(context.Background(), []string{"--remote", ts.URL, f}, &remote); err != nil {
		t.Fatal(err)
	}
	ids := func(s string) [][]uint32 {
		var out [][]uint32
		for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
			var v struct{ IDs []uint32 }
			json.Unmarshal([]byte(l), &v)
			out = append(out, v.IDs)
		}
		return out
	}
	a, b := ids(simple.String()), ids(remote.String())
	if len(a) != 2 || !slices.EqualFunc(a, b, slices.Equal) || len(a[1]) != 6 {
		t.Fatalf("simple %v, remote %v", a, b)
	}
	if !strings.Contains(simple.String(), `"rendered":"### user: hi\n"`) || strings.Contains(remote.String(), "rendered") {
		t.Fatalf("rendered: simple %s remote %s", simple.String(), remote.String())
	}
}

func TestTokenizeErrors(t *testing.T) {
	dir := filepath.Join(tokTestdata, "qwen3")
	bad := filepath.Join(t.TempDir(), "bad.jsonl")
	tests := []struct {
		name  string
		args  []string
		input string
		usage bool
		want  string
	}{
		{"no source", []string{}, "", true, "exactly one"},
		{"two sources", []string{"--simple", "--model-dir", dir}, "", true, "exactly one"},
		{"unknown flag", []string{"--nope"}, "", true, "nope"},
		{"bad remote URL", []string{"--remote", "localhost:1"}, "", true, "absolute"},
		{"missing dir", []string{"--model-dir", "/nonexistent"}, "", false, "tokenizer.json"},
		{"not JSON", []string{"--simple", bad}, "hello\n", false, "line 1"},
		{"array", []string{"--simple", bad}, "[1]\n", false, "object"},
		{"neither text nor messages", []string{"--simple", bad}, `{"x":1}` + "\n", false, "text"},
		{"text not a string", []string{"--simple", bad}, `{"text":5}` + "\n", false, "string"},
		{"bad message", []string{"--simple", bad}, `{"messages":[{"role":"user","content":7}]}` + "\n", false, "messages"},
		{"trailing data", []string{"--simple", bad}, `{"text":"a"} {}` + "\n", false, "trailing"},
		{"missing file", []string{"--simple", "/nonexistent.jsonl"}, "", false, "nonexistent"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			os.WriteFile(bad, []byte(tt.input), 0o644)
			err := runTokenize(context.Background(), tt.args, &bytes.Buffer{})
			if err == nil || errors.Is(err, errUsage) != tt.usage || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v; want usage=%v containing %q", err, tt.usage, tt.want)
			}
		})
	}
	var out bytes.Buffer
	if err := runTokenize(context.Background(), []string{"--help"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "usage: kvctl tokenize") {
		t.Fatalf("--help: %v %q", err, out.String())
	}
}

// FuzzTokenizeLine: any input line is tokenized or rejected with an error, never a panic,
// and what comes out is one JSON object.
func FuzzTokenizeLine(f *testing.F) {
	f.Add([]byte(`{"text":"hello, world","x":[1,2]}`))
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false,"ids":[1],"rendered":"x"}`))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"tools":[{"a":1}],"chat_template_kwargs":{"k":true}}`))
	f.Add([]byte(`{"text":"a","text":"b"}`))
	src := localSource(tokenizer.Simple{})
	f.Fuzz(func(t *testing.T, line []byte) {
		for _, check := range []bool{false, true} {
			out, _, err := tokenizeLine(context.Background(), line, src, check)
			if err != nil {
				continue
			}
			var obj map[string]json.RawMessage
			if err := json.Unmarshal(out, &obj); err != nil || obj["ids"] == nil {
				t.Fatalf("%s -> %s: %v", line, out, err)
			}
		}
	})
}

// TestTokenizeSpecialTokens: "add_special_tokens": true applies the model's post-processor
// (the Llama-2-style test file puts <s> = 1 first), false or absent does not.
func TestTokenizeSpecialTokens(t *testing.T) {
	f := filepath.Join(t.TempDir(), "in.jsonl")
	os.WriteFile(f, []byte(`{"text":"hello world","add_special_tokens":true}`+"\n"+`{"text":"hello world"}`+"\n"+`{"text":"x","add_special_tokens":"yes"}`+"\n"), 0o644)
	var out bytes.Buffer
	err := runTokenize(context.Background(), []string{"--model-dir", filepath.Join(tokTestdata, "sentencepiece", "llama2"), f}, &out)
	if err == nil || !strings.Contains(err.Error(), "line 3") {
		t.Fatalf("err = %v, want line 3 rejected", err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []string{
		`{"text":"hello world","add_special_tokens":true,"ids":[1,311,353]}`,
		`{"text":"hello world","ids":[311,353]}`,
	}
	if !slices.Equal(lines, want) {
		t.Fatalf("got\n%s\nwant\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
}
