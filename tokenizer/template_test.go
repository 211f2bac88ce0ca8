package tokenizer

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ardanlabs/jinja"
)

func TestJinjaTemplate(t *testing.T) {
	now := func() time.Time { return time.Date(2026, 7, 4, 15, 4, 5, 0, time.UTC) }
	parts := []Message{}
	if err := json.Unmarshal([]byte(`[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"b"}]}]`), &parts); err != nil {
		t.Fatal(err)
	}
	var call Message
	if err := json.Unmarshal([]byte(`{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"z\": 1, \"a\": [2]}"}}]}`), &call); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, src string
		msgs      []Message
		opts      RenderOptions
		want      string
	}{
		{"strftime_now on the given clock", `{{ strftime_now("%d %b %Y %H:%M:%S %A %B %y %j %%") }}`, nil, RenderOptions{Now: now},
			"04 Jul 2026 15:04:05 Saturday July 26 185 %"},
		{"bos eos and generation prompt", `{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}`, nil, RenderOptions{AddGenerationPrompt: true}, "<s>|</s>|True"},
		{"loop vars and namespace", `{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ loop.index }}{{ m.role[0] }}{% if not loop.last %},{% endif %}{% endfor %}={{ ns.n }}`,
			[]Message{{Role: "user"}, {Role: "assistant"}, {Role: "user"}}, RenderOptions{}, "1u,2a,3u=3"},
		{"tools keep key order in tojson", `{{ tools | tojson }}`, nil, RenderOptions{Tools: json.RawMessage(`[{"z":1,"a":{"y":true,"b":null}}]`)},
			`[{"z": 1, "a": {"y": true, "b": null}}]`},
		{"empty tools are an empty list", `{{ tools is defined }} {{ tools is none }} {{ tools | length }}`, nil, RenderOptions{Tools: json.RawMessage(`[]`)}, "True False 0"},
		{"vars", `{{ enable_thinking }}`, nil, RenderOptions{Vars: map[string]any{"enable_thinking": false}}, "False"},
		{"string content joins text parts", `{{ messages[0].content }}`, parts, RenderOptions{}, "a\nb"},
		{"parts for templates that loop over content", `{% for p in messages[0].content %}{{ p.type }};{% endfor %}`, parts, RenderOptions{}, "text;image;text;"},
		{"tool call arguments parsed to an object", `{{ messages[0].content is none }} {{ messages[0].tool_calls[0].function.arguments | tojson }} {{ messages[0].tool_calls[0].function.arguments.z }}`,
			[]Message{call}, RenderOptions{}, `False {"z": 1, "a": [2]} 1`},
		{"optional keys absent", `{{ messages[0].name is defined }}{{ messages[0].tool_calls is defined }}`, []Message{{Role: "user", Content: "x"}}, RenderOptions{}, "FalseFalse"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			j, err := NewJinjaTemplate(tt.src, TemplateConfig{BOSToken: "<s>", EOSToken: "</s>"})
			if err != nil {
				t.Fatal(err)
			}
			got, err := j.Render(tt.msgs, tt.opts)
			if err != nil || got != tt.want {
				t.Fatalf("Render = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
	j, _ := NewJinjaTemplate(`{{ raise_exception("roles must alternate") }}`, TemplateConfig{})
	if _, err := j.Render(nil, RenderOptions{}); !errors.Is(err, ErrTemplate) || !strings.Contains(err.Error(), "roles must alternate") {
		t.Fatalf("raise_exception: %v", err)
	}
	j, _ = NewJinjaTemplate(`{{ tools }}`, TemplateConfig{})
	if _, err := j.Render(nil, RenderOptions{Tools: json.RawMessage(`[{`)}); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("bad tools JSON: %v", err)
	}
}

// TestTemplateFeatureVectors renders a template written to exercise what real chat
// templates use (tojson with indent and separators, items, slicing, "in" on dicts, type
// tests, namespace, loop variables, string methods, filters) against @huggingface/jinja's
// output (testdata/refvectors.mjs).
func TestTemplateFeatureVectors(t *testing.T) {
	type fvec struct {
		Template            string          `json:"template"`
		Messages            []Message       `json:"messages"`
		Tools               json.RawMessage `json:"tools"`
		AddGenerationPrompt bool            `json:"add_generation_prompt"`
		Rendered            string          `json:"rendered"`
	}
	vecs := readJSONLines[fvec](t, "testdata/tools/features.jsonl")
	if len(vecs) != 3 {
		t.Fatalf("%d vectors", len(vecs))
	}
	for i, v := range vecs {
		j, err := NewJinjaTemplate(v.Template, TemplateConfig{BOSToken: "<s>"})
		if err != nil {
			t.Fatal(err)
		}
		got, err := j.Render(v.Messages, RenderOptions{AddGenerationPrompt: v.AddGenerationPrompt, Tools: v.Tools})
		if err != nil || got != v.Rendered {
			t.Errorf("case %d: %v\n got %q\nwant %q", i, err, got, v.Rendered)
		}
	}
}

func TestPyTojson(t *testing.T) {
	tests := []struct {
		src, want string
	}{
		{`{{ x | tojson }}`, `{"b": [1, 2.0, 1e+16, 1e-05, 0.0001, 123456789.0], "a": "<&>` + "\u2028" + `\"\\\n\u0001", "c": {}, "d": [], "e": null, "f": true}`},
		{`{{ x | tojson(indent=2) }}`, "{\n  \"b\": [\n    1,\n    2.0,\n    1e+16,\n    1e-05,\n    0.0001,\n    123456789.0\n  ],\n  \"a\": \"<&>\u2028\\\"\\\\\\n\\u0001\",\n  \"c\": {},\n  \"d\": [],\n  \"e\": null,\n  \"f\": true\n}"},
		{`{{ x.b | tojson(separators=(",", ":")) }}`, `[1,2.0,1e+16,1e-05,0.0001,123456789.0]`},
		{`{{ x.a|tojson }}`, `"<&>` + "\u2028" + `\"\\\n\u0001"`},
	}
	x, err := jsonValue([]byte(`{"b":[1,2.0,1e16,0.00001,0.0001,123456789.0],"a":"<&>` + "\u2028" + `\"\\\n\u0001","c":{},"d":[],"e":null,"f":true}`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		j, err := NewJinjaTemplate(tt.src, TemplateConfig{})
		if err != nil {
			t.Fatal(err)
		}
		// Vars go through FromGoValue (sorted keys); pass the ordered value directly.
		got, err := j.t.RenderValues(map[string]jinja.Value{"x": x, pyTojsonName: pyTojson})
		if err != nil || got != tt.want {
			t.Errorf("%s:\n got %q, %v\nwant %q", tt.src, got, err, tt.want)
		}
	}
}
