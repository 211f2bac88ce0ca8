package tokenizer

import (
	"bufio"
	"encoding/json"
	"hash/fnv"
	"os"
	"regexp"
	"slices"
	"testing"
)

type captureRequest struct {
	Label   string `json:"label"`
	Path    string `json:"path"`
	Request *struct {
		Model    string    `json:"model"`
		Prompt   string    `json:"prompt"`
		Messages []Message `json:"messages"`
	} `json:"request"`
	Usage *struct {
		PromptTokens int `json:"prompt_tokens"`
	} `json:"usage"`
}

// readVectors reads a reference-vector file, one T a line, and fails the
// test when it holds fewer than least (a truncated or emptied file).
func readVectors[T any](t testing.TB, path string, least int) []T {
	t.Helper()
	vecs := readJSONLines[T](t, path)
	if len(vecs) < least {
		t.Fatalf("%s: only %d vectors", path, len(vecs))
	}
	return vecs
}

func readJSONLines[T any](t testing.TB, path string) []T {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	defer f.Close()
	var out []T
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	for sc.Scan() {
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			t.Fatalf("%s line %d: %v", path, len(out)+1, err)
		}
		out = append(out, v)
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return out
}

// TestSimpleReproducesCaptures re-tokenizes every request of the llm-d-inference-sim capture
// and checks (1) the prompt token count the simulator reported and (2) that every
// BlockStored token_ids list equals a block-aligned run of full blocks of some request.
func TestSimpleReproducesCaptures(t *testing.T) {
	const blockSize = 16
	var tok Simple
	reqs := readJSONLines[captureRequest](t, "testdata/simple/requests.jsonl")
	var seqs [][]uint32
	for _, r := range reqs {
		if r.Request == nil {
			continue
		}
		var ids []uint32
		var err error
		if r.Path == "/v1/chat/completions" {
			ids, _, err = EncodeChat(tok, r.Request.Messages, RenderOptions{AddGenerationPrompt: true})
		} else {
			ids, err = tok.Encode(r.Request.Prompt)
		}
		if err != nil {
			t.Fatalf("%s: %v", r.Label, err)
		}
		if got, want := len(ids), r.Usage.PromptTokens; got != want {
			t.Errorf("%s: %d tokens, simulator reported %d", r.Label, got, want)
		}
		seqs = append(seqs, ids)
	}
	if len(seqs) != 13 {
		t.Fatalf("expected 13 request bodies, got %d", len(seqs))
	}

	type capture struct {
		Seq     int   `json:"seq"`
		Decoded []any `json:"decoded"`
	}
	stored := 0
	for _, c := range readJSONLines[capture](t, "testdata/simple/array.jsonl") {
		evs, _ := c.Decoded[1].([]any)
		for _, e := range evs {
			ev, _ := e.([]any)
			if len(ev) < 4 || ev[0] != "BlockStored" {
				continue
			}
			raw, _ := ev[3].([]any)
			want := make([]uint32, len(raw))
			for i, v := range raw {
				want[i] = uint32(v.(float64))
			}
			if len(want) == 0 || len(want)%blockSize != 0 {
				t.Fatalf("seq %d: token_ids length %d is not whole blocks", c.Seq, len(want))
			}
			stored++
			if !matchesBlockRun(seqs, want, blockSize) {
				t.Errorf("seq %d: BlockStored token_ids (%d tokens, first %v) match no request", c.Seq, len(want), want[:3])
			}
		}
	}
	if stored != 12 {
		t.Fatalf("expected 12 BlockStored events, got %d", stored)
	}
}

// matchesBlockRun reports whether want equals seq[k*B : k*B+len(want)] for some request
// such that the run ends exactly at the request's last full block (the engine stores new
// full blocks, from the first uncached one to the last full one).
func matchesBlockRun(seqs [][]uint32, want []uint32, b int) bool {
	for _, s := range seqs {
		end := len(s) / b * b
		start := end - len(want)
		if start >= 0 && start%b == 0 && slices.Equal(s[start:end], want) {
			return true
		}
	}
	return false
}

func TestSimpleEncode(t *testing.T) {
	h := func(s string) uint32 { f := fnv.New32a(); f.Write([]byte(s)); return f.Sum32() }
	tests := []struct {
		text string
		want []uint32
	}{
		{"", []uint32{}},
		{"   ", []uint32{}},
		{"hello", []uint32{h("hello")}},
		{"hello  world", []uint32{h("hello  "), h("world")}},
		{"### user: hi\n", []uint32{h("#"), h("#"), h("# "), h("user"), h(": "), h("hi\n")}},
		{"a,b.c!", []uint32{h("a"), h(","), h("b"), h("."), h("c"), h("!")}},
		{"naïve", []uint32{h("na"), h("ve")}}, // \w is ASCII-only in RE2; ï is dropped
		{"x_y-z", []uint32{h("x_y"), h("-"), h("z")}},
	}
	for _, tt := range tests {
		got, err := Simple{}.Encode(tt.text)
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("Encode(%q) = %v, %v; want %v", tt.text, got, err, tt.want)
		}
	}
}

// TestSimpleRender checks the flattening against llm-d-inference-sim's rules (see Render):
// messages as a chat request sends them, expected text written from the simulator's source.
func TestSimpleRender(t *testing.T) {
	tests := []struct {
		name, messages, want string
	}{
		{"plain", `[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]`,
			"### system: be brief\n### user: hi\n"},
		{"tool calling turn",
			`[{"role":"user","content":"weather in Paris?"},
			  {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
			  {"role":"tool","tool_call_id":"call_1","content":"sunny, 21C"},
			  {"role":"assistant","content":"It is sunny."}]`,
			"### user: weather in Paris?\n### assistant: [get_weather({\"city\": \"Paris\"})]\n### tool(call_1): sunny, 21C\n### assistant: It is sunny.\n"},
		{"content and two calls", `[{"role":"assistant","content":"checking","tool_calls":[
			  {"id":"a","function":{"name":"f","arguments":"{}"}},{"id":"b","function":{"name":"g","arguments":"{\"x\":1}"}}]}]`,
			"### assistant: checking[f({})][g({\"x\":1})]\n"},
		{"call without a name is skipped", `[{"role":"assistant","content":null,"tool_calls":[{"id":"a","function":{"arguments":"{}"}}]}]`,
			"### assistant: \n"},
		{"arguments sent as an object", `[{"role":"assistant","content":null,"tool_calls":[{"id":"a","function":{"name":"f","arguments":{"k":"v"}}}]}]`,
			"### assistant: [f({\"k\":\"v\"})]\n"},
		{"content parts: text and image lines", `[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"http://x/y.png"}},{"type":"input_audio","input_audio":{"data":"AA=="}},{"type":"text","text":"at this"}]}]`,
			"### user: look\nimage: http://x/y.png\nat this\n"},
		{"name is not rendered", `[{"role":"user","name":"bob","content":"hi"}]`, "### user: hi\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var msgs []Message
			if err := json.Unmarshal([]byte(tt.messages), &msgs); err != nil {
				t.Fatal(err)
			}
			got, err := Simple{}.Render(msgs, RenderOptions{AddGenerationPrompt: true})
			if err != nil || got != tt.want {
				t.Fatalf("Render = %q, %v\nwant     %q", got, err, tt.want)
			}
		})
	}
}

// FuzzSimpleEncode proves the hand-written scanner equal to the documented regex run by
// Go's regexp, for any input.
func FuzzSimpleEncode(f *testing.F) {
	f.Add("### user: hello, world!\n")
	f.Add("naïve \x00\xff {}[] _x x_ __ a\vb a\fb \u00a0 \u3000 '\"\\")
	re := regexp.MustCompile(simplePattern)
	f.Fuzz(func(t *testing.T, s string) {
		ids, err := Simple{}.Encode(s)
		if err != nil {
			t.Fatal(err)
		}
		locs := re.FindAllStringIndex(s, -1)
		want := make([]uint32, len(locs))
		for i, l := range locs {
			want[i] = fnv32a(s[l[0]:l[1]])
		}
		if !slices.Equal(ids, want) {
			t.Fatalf("Encode(%q) = %v, regexp gives %v", s, ids, want)
		}
	})
}

func BenchmarkSimpleEncode(b *testing.B) {
	text := ""
	for len(text) < 32<<10 {
		text += "india silver glacier echo, quebec hotel: indigo (glacier) yellow-blue mountain.\n"
	}
	cpuLoop(b, len(text), func() {
		if _, err := (Simple{}).Encode(text); err != nil {
			b.Fatal(err)
		}
	})
}
