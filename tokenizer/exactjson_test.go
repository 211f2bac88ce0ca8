package tokenizer

import (
	"bytes"
	"encoding/json"
	"testing"
)

// A message is read by exact keys, as vLLM reads one (a TypedDict:
// message["content"]): a key equal to a field only up to case is ignored,
// where encoding/json would read it as the field (the last one winning).
func TestMessageKeysExact(t *testing.T) {
	var m Message
	b := `{"role":"assistant","Role":"user","content":"a","CONTENT":"b","tool_calls":[{"id":"1","type":"function",` +
		`"function":{"name":"f","arguments":"{}","NAME":"g"},"Function":{"name":"h"},"ID":"2"}],"Tool_Call_Id":"x","Name":"n","reaſoning":"r"}`
	if err := json.Unmarshal([]byte(b), &m); err != nil {
		t.Fatal(err)
	}
	if m.Role != "assistant" || m.Content != "a" || m.ToolCallID != "" || m.NameSet || m.ReasoningSet {
		t.Fatalf("message %+v: a case variant was read as its field", m)
	}
	if len(m.ToolCalls) != 1 || m.ToolCalls[0].ID != "1" || m.ToolCalls[0].Function.Name != "f" || string(m.ToolCalls[0].Function.Arguments) != `"{}"` {
		t.Fatalf("tool calls %+v: a case variant was read as its field", m.ToolCalls)
	}
	// Exact keys alone decode as before.
	var plain Message
	if err := json.Unmarshal([]byte(`{"role":"user","content":"hi","name":"n","tool_call_id":"t"}`), &plain); err != nil ||
		plain.Role != "user" || plain.Content != "hi" || plain.Name != "n" || !plain.NameSet || plain.ToolCallID != "t" {
		t.Fatalf("%+v %v", plain, err)
	}
}

type exactProbe struct {
	Messages json.RawMessage `json:"messages"`
	Model    string          `json:"model"`
	N        *int            `json:"n,omitempty"`
	Skip     string          `json:"-"`
	Plain    bool
}

// FuzzUnmarshalExact: any input decodes without panic; a field holds the
// value of its exact key (the last when repeated) or nothing, never a case
// variant's; with no case variant present, the answer is encoding/json's.
func FuzzUnmarshalExact(f *testing.F) {
	f.Add([]byte(`{"messages":[1],"model":"m","n":2,"Plain":true}`))
	f.Add([]byte(`{"Messages":[1],"messages":[2],"MODEL":"x"}`))
	f.Add([]byte(`{"meſſages":[1],"\u004dodel":"x","model":"y","plain":true}`))
	f.Add([]byte(`{"n":"x","N":1}`))
	f.Add([]byte(`[1,2]`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"model":"a","model":"b"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var got, std exactProbe
		err := UnmarshalExact(b, &got)
		stdErr := json.Unmarshal(b, &std)
		var members map[string]json.RawMessage
		if json.Unmarshal(b, &members) != nil || members == nil {
			// Not an object: encoding/json's answer.
			if (err == nil) != (stdErr == nil) {
				t.Fatalf("%q: %v, encoding/json %v", b, err, stdErr)
			}
			return
		}
		variant := false
		for k := range members {
			for _, n := range []string{"messages", "model", "n", "Plain"} {
				if k != n && bytes.EqualFold([]byte(k), []byte(n)) {
					variant = true
				}
			}
		}
		if !variant {
			gj, _ := json.Marshal(got)
			sj, _ := json.Marshal(std)
			if (err == nil) != (stdErr == nil) || !bytes.Equal(gj, sj) {
				t.Fatalf("%q: %s %v, encoding/json %s %v", b, gj, err, sj, stdErr)
			}
			return
		}
		if err != nil {
			return // a type error in an exact member
		}
		var want exactProbe
		if raw, ok := members["model"]; ok {
			_ = json.Unmarshal(raw, &want.Model)
		}
		if got.Model != want.Model {
			t.Fatalf("%q: model %q, want %q (exact key only)", b, got.Model, want.Model)
		}
		raw, ok := members["messages"]
		if ok != (got.Messages != nil) || ok && !bytes.Equal(bytes.TrimSpace(raw), bytes.TrimSpace(got.Messages)) && !jsonEqual(raw, got.Messages) {
			t.Fatalf("%q: messages %s, want %s", b, got.Messages, raw)
		}
		if _, ok := members["n"]; !ok && got.N != nil {
			t.Fatalf("%q: n read from a case variant", b)
		}
	})
}

func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xj, _ := json.Marshal(x)
	yj, _ := json.Marshal(y)
	return bytes.Equal(xj, yj)
}
