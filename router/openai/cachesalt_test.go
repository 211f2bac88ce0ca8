package openai

import (
	"bytes"
	"encoding/json"
	"testing"
)

func TestInjectCacheSalt(t *testing.T) {
	tests := []struct {
		name      string
		body      string
		overwrite bool
		want      string // "" = error
	}{
		{"adds to an object", `{"model":"m","prompt":"hi"}`, true, `{"cache_salt":"S","model":"m","prompt":"hi"}`},
		{"empty object", ` { } `, true, `{"cache_salt":"S"}`},
		{"overwrites the client's", `{"cache_salt":"theirs","model":"m"}`, true, `{"cache_salt":"S","model":"m"}`},
		{"overwrites every duplicate", `{"cache_salt":"x","a":1,"cache_salt":"y"}`, true, `{"cache_salt":"S","a":1}`},
		{"escaped key is the same key", `{"cache\u005fsalt":"x","a":1}`, true, `{"cache_salt":"S","a":1}`},
		{"keeps the client's", `{"cache_salt":"theirs","model":"m"}`, false, `{"cache_salt":"theirs","model":"m"}`},
		{"keep adds when absent", `{"model":"m"}`, false, `{"cache_salt":"S","model":"m"}`},
		{"nested cache_salt is not top level", `{"x":{"cache_salt":"n"}}`, true, `{"cache_salt":"S","x":{"cache_salt":"n"}}`},
		{"member bytes verbatim", "{\"messages\" :\n [ {\"content\":\"a\\nb\"} ] }", true, "{\"cache_salt\":\"S\",\"messages\" :\n [ {\"content\":\"a\\nb\"} ]}"},
		{"array is not an object", `[1,2]`, true, ""},
		{"string body", `"hello"`, true, ""},
		{"not JSON", `hello`, true, ""},
		{"truncated", `{"a":1`, true, ""},
		{"trailing data", `{"a":1} x`, true, ""},
		{"empty", ``, true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := InjectCacheSalt([]byte(tc.body), "S", tc.overwrite)
			if tc.want == "" {
				if err == nil {
					t.Fatalf("want an error, got %s", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

// FuzzInjectCacheSalt: any input either fails or yields a JSON object whose
// top-level cache_salt is the salt and whose other members are the input's.
func FuzzInjectCacheSalt(f *testing.F) {
	for _, s := range []string{`{}`, `{"a":1}`, `{"cache_salt":"x","b":[1,{"c":2}]}`, `[1]`, `{"a":`, "{\"a\"\t:\"\\u00e9\"}", `{"cache_salt":1,"cache_salt":null}`} {
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, overwrite bool) {
		out, err := InjectCacheSalt(body, "salt-\"q\"", overwrite)
		if err != nil {
			return
		}
		var in, got map[string]json.RawMessage
		if err := json.Unmarshal(body, &in); err != nil {
			// encoding/json is stricter on UTF-8 and duplicate handling is
			// the same; a body it rejects that we accepted must at least
			// come out as valid JSON.
			if !json.Valid(out) {
				t.Fatalf("invalid output %q from %q", out, body)
			}
			return
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("output %q: %v", out, err)
		}
		var salt string
		_ = json.Unmarshal(got["cache_salt"], &salt)
		if _, had := in["cache_salt"]; had && !overwrite {
			if !bytes.Equal(out, body) {
				t.Fatalf("keep changed the body: %q -> %q", body, out)
			}
			return
		}
		if salt != "salt-\"q\"" {
			t.Fatalf("cache_salt %q in %q", salt, out)
		}
		for k, v := range in {
			if k != "cache_salt" && !bytes.Equal(bytes.TrimSpace(v), bytes.TrimSpace(got[k])) {
				t.Fatalf("member %q changed: %s -> %s", k, v, got[k])
			}
		}
		if len(got) != len(in)+1 && len(got) != len(in) {
			t.Fatalf("members %d -> %d", len(in), len(got))
		}
	})
}

// jsonCacheSalt is the general path: what encoding/json (last duplicate
// wins, as in vLLM's Python parser) reads as the top-level cache_salt.
func jsonCacheSalt(body []byte) (string, bool) {
	var v struct {
		CacheSalt string `json:"cache_salt"`
	}
	if json.Unmarshal(body, &v) != nil {
		return "", false
	}
	return v.CacheSalt, true
}

func TestLeadingCacheSalt(t *testing.T) {
	tests := []struct {
		body string
		want string
		ok   bool
	}{
		{`{"cache_salt":"abc_-9","model":"m"}`, "abc_-9", true},
		{`{"cache_salt":"abc"}`, "abc", true},
		{`{"cache_salt":"abc","x":1,"cache_salt":"later"}`, "", false},
		{`{"cache_salt":"abc","cache\u005fsalt":"later"}`, "", false},
		{`{"cache_salt":"a b","model":"m"}`, "", false},
		{`{"cache_salt":"abc"`, "", false},
		{`{"model":"m","cache_salt":"abc"}`, "", false},
		{` {"cache_salt":"abc"}`, "", false},
		// encoding/json matches keys case-insensitively, the long s too.
		{`{"cache_salt":"00","CAChE_sAlt":"0"}`, "", false},
		{`{"cache_salt":"00","cache_ſalt":"0"}`, "", false},
		{`{"cache_salt":"00","a_b":"x_y","_":1}`, "00", true},
	}
	for _, tc := range tests {
		got, ok := LeadingCacheSalt([]byte(tc.body))
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: got %q %v, want %q %v", tc.body, got, ok, tc.want, tc.ok)
		}
	}
}

// FuzzLeadingCacheSalt: whenever the fast path answers, on a valid body,
// it agrees with encoding/json.
func FuzzLeadingCacheSalt(f *testing.F) {
	f.Add([]byte(`{"cache_salt":"abc","model":"m"}`))
	f.Add([]byte(`{"cache_salt":"abc","x":{"cache_salt":"y"}}`))
	f.Add([]byte(`{"cache_salt":"abc","cach\u0065_salt":"z"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		fast, ok := LeadingCacheSalt(body)
		if !ok {
			return
		}
		if slow, valid := jsonCacheSalt(body); valid && slow != fast {
			t.Fatalf("%q: fast %q, encoding/json %q", body, fast, slow)
		}
	})
}
