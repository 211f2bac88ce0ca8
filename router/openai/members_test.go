package openai

import (
	"encoding/json"
	"maps"
	"testing"
	"unicode/utf8"
)

func TestSetMembers(t *testing.T) {
	body := []byte(`{"cache_salt":"s", "model":"m","stream" : true,"max_tokens":9,"stream":true,"prompt":"a \"quoted\" }"}`)
	out, err := SetMembers(body,
		Member{"stream", json.RawMessage(`false`)},
		Member{"max_tokens", json.RawMessage(`1`)},
		Member{"stream_options", nil},
		Member{"kv_transfer_params", json.RawMessage(`{"do_remote_decode":true}`)})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"cache_salt":"s","model":"m","prompt":"a \"quoted\" }","stream":false,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}`
	if string(out) != want {
		t.Fatalf("SetMembers =\n%s\nwant\n%s", out, want)
	}
	for _, bad := range []string{``, `[]`, `{"a":}`, `{"a":1} x`, `{"a" 1}`} {
		if _, err := SetMembers([]byte(bad), Member{"b", json.RawMessage(`1`)}); err == nil {
			t.Errorf("SetMembers(%q) accepted", bad)
		}
	}
	if out, _ := SetMembers([]byte(` { } `), Member{"k", json.RawMessage(`null`)}); string(out) != `{"k":null}` {
		t.Errorf("empty object: %s", out)
	}
}

// FuzzSetMembers: on any body encoding/json reads as an object without
// repeated keys, the edited body is valid JSON and equals the original
// with the members set and removed.
func FuzzSetMembers(f *testing.F) {
	f.Add([]byte(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`), "stream", []byte(`false`))
	f.Add([]byte(`{}`), "kv_transfer_params", []byte(`{"do_remote_prefill":true,"remote_block_ids":[1,2]}`))
	f.Add([]byte(`{"a":{"b":[1,2,{"c":null}]},"\u00e9":"x"}`), "a", []byte(nil))
	f.Fuzz(func(t *testing.T, body []byte, key string, value []byte) {
		var orig map[string]json.RawMessage
		if json.Unmarshal(body, &orig) != nil || orig == nil {
			return
		}
		if value != nil && !json.Valid(value) {
			return
		}
		if !utf8.ValidString(key) {
			if _, err := SetMembers(body, Member{key, value}); err == nil {
				t.Fatalf("SetMembers took the non-UTF-8 key %q", key)
			}
			return
		}
		// Repeated keys: encoding/json keeps the last, parsers differ; skip.
		spans, err := topMembers(body)
		if err != nil {
			t.Fatalf("topMembers refused a body encoding/json reads: %v", err)
		}
		if len(spans) != len(orig) {
			return
		}
		out, err := SetMembers(body, Member{key, value})
		if err != nil {
			t.Fatalf("SetMembers: %v", err)
		}
		var got map[string]json.RawMessage
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("edited body %q is not JSON: %v", out, err)
		}
		want := maps.Clone(orig)
		delete(want, key)
		if value != nil {
			want[key] = value
		}
		if len(got) != len(want) {
			t.Fatalf("edited body has %d members, want %d: %s", len(got), len(want), out)
		}
		for k, v := range want {
			var a, b any
			_ = json.Unmarshal(v, &a)
			_ = json.Unmarshal(got[k], &b)
			ja, _ := json.Marshal(a)
			jb, _ := json.Marshal(b)
			if string(ja) != string(jb) {
				t.Fatalf("member %q = %s, want %s", k, got[k], v)
			}
		}
	})
}
