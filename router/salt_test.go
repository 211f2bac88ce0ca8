package router

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/kvrouter/kvrouter/router/routertest"
)

var testSaltSecret = bytes.Repeat([]byte{0x5a}, 32)

func TestDecodeCacheSaltSecret(t *testing.T) {
	tests := []struct {
		name, in string
		want     int // bytes; -1 = error
	}{
		{"empty means none", "", 0},
		{"32 bytes", strings.Repeat("ab", 32), 32},
		{"16 bytes minimum", strings.Repeat("0f", 16), 16},
		{"too short", strings.Repeat("0f", 15), -1},
		{"not hex", strings.Repeat("zz", 16), -1},
		{"odd length", strings.Repeat("a", 33), -1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := config.DecodeCacheSaltSecret(tc.in)
			if tc.want < 0 {
				if err == nil {
					t.Fatalf("want an error, got %d bytes", len(b))
				}
				return
			}
			if err != nil || len(b) != tc.want {
				t.Fatalf("got %d bytes, %v; want %d", len(b), err, tc.want)
			}
		})
	}
}

func TestDeriveCacheSalt(t *testing.T) {
	a1 := DeriveCacheSalt(testSaltSecret, "tenant-a")
	a2 := DeriveCacheSalt(testSaltSecret, "tenant-a")
	b := DeriveCacheSalt(testSaltSecret, "tenant-b")
	other := DeriveCacheSalt(bytes.Repeat([]byte{1}, 32), "tenant-a")
	if a1 != a2 {
		t.Fatalf("equal tenants, different salts: %q %q", a1, a2)
	}
	if a1 == b {
		t.Fatalf("different tenants, same salt %q", a1)
	}
	if a1 == other {
		t.Fatalf("the salt does not depend on the secret")
	}
	if len(a1) != 43 || strings.ContainsAny(a1, "+/=\"\\") {
		t.Fatalf("salt %q: want 43 base64url characters", a1)
	}
}

func TestSaltBody(t *testing.T) {
	body := []byte(`{"cache_salt":"chosen","prompt":"p"}`)
	salt := DeriveCacheSalt(testSaltSecret, "t1")
	tests := []struct {
		name   string
		cfg    *config.CacheSaltConfig
		secret []byte
		tenant string
		want   string // cache_salt upstream
	}{
		{"no section", nil, testSaltSecret, "t1", "chosen"},
		{"disabled", &config.CacheSaltConfig{}, testSaltSecret, "t1", "chosen"},
		{"no tenant keeps the body", &config.CacheSaltConfig{Enabled: true}, testSaltSecret, "", "chosen"},
		{"overwrite by default", &config.CacheSaltConfig{Enabled: true}, testSaltSecret, "t1", salt},
		{"keep", &config.CacheSaltConfig{Enabled: true, Client: config.CacheSaltKeep}, testSaltSecret, "t1", "chosen"},
		{"no secret", &config.CacheSaltConfig{Enabled: true}, nil, "t1", "chosen"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out := saltBody(tc.cfg, tc.secret, tc.tenant, body)
			var v struct {
				CacheSalt string `json:"cache_salt"`
				Prompt    string `json:"prompt"`
			}
			if err := json.Unmarshal(out, &v); err != nil {
				t.Fatalf("%s: %v", out, err)
			}
			if v.CacheSalt != tc.want || v.Prompt != "p" {
				t.Fatalf("cache_salt %q prompt %q; want %q, p", v.CacheSalt, v.Prompt, tc.want)
			}
		})
	}
	// A body the salt must go into but that is not one strict JSON object
	// is refused, not forwarded with the client's own cache_salt: vLLM's
	// json.loads reads the ones with NaN, Infinity, a BOM or UTF-16.
	for _, b := range []string{"not json", `[1]`, `{"cache_salt":"chosen","t":NaN}`, `{"cache_salt":"chosen","t":-Infinity}`,
		"\ufeff" + `{"cache_salt":"chosen"}`, utf16LE(`{"cache_salt":"chosen"}`)} {
		out, salt, err := saltRequestBody(&config.CacheSaltConfig{Enabled: true}, testSaltSecret, "t1", []byte(b))
		if re := AsRequestError(err); err == nil || re.Status != 400 || !strings.Contains(re.Message, "body must be a JSON object") || out != nil || salt != "" {
			t.Errorf("%q: body %q salt %q, err %v; want the 400 of NotJSONObject", b, out, salt, err)
		}
	}
	// Without a tenant nothing is written, and nothing is asked of the body.
	if out, _, err := saltRequestBody(&config.CacheSaltConfig{Enabled: true}, testSaltSecret, "", []byte("not json")); err != nil || string(out) != "not json" {
		t.Fatalf("no tenant: %q %v", out, err)
	}
}

// utf16LE is s (ASCII) in UTF-16LE, as Python's json.loads detects it.
func utf16LE(s string) string {
	b := make([]byte, 0, 2*len(s))
	for i := 0; i < len(s); i++ {
		b = append(b, s[i], 0)
	}
	return string(b)
}

// BenchmarkSaltBody: deriving the salt and rewriting the body, per
// request of a cache_salt pool, by body size.
func BenchmarkSaltBody(b *testing.B) {
	for _, n := range []int{2 << 10, 32 << 10, 256 << 10} {
		body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", n) + `"}],"stream":true}`)
		cfg := &config.CacheSaltConfig{Enabled: true}
		b.Run(fmt.Sprintf("%dKiB", n>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if out := saltBody(cfg, testSaltSecret, "tenant-a", body); len(out) <= len(body) {
					b.Fatal("not salted")
				}
			}
		})
	}
}

// BenchmarkCacheSaltOfSaltedBody: what kv_aware pays to read the salt back
// from a body saltBody wrote.
func BenchmarkCacheSaltOfSaltedBody(b *testing.B) {
	for _, n := range []int{2 << 10, 256 << 10} {
		body := saltBody(&config.CacheSaltConfig{Enabled: true}, testSaltSecret, "tenant-a", []byte(`{"model":"m","prompt":"`+strings.Repeat("x", n)+`"}`))
		req := &Request{Body: body}
		b.Run(fmt.Sprintf("%dKiB", n>>10), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if req.CacheSalt() == "" {
					b.Fatal("no salt")
				}
			}
		})
	}
}

// TestCacheSaltOfRequest: kv_aware's salt, by each way it can be known,
// with vLLM's exact key match (encoding/json would fold "Cache_Salt").
func TestCacheSaltOfRequest(t *testing.T) {
	parse := func(body string) *openai.Request {
		r, err := ParseOpenAI(EndpointCompletions, []byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		return r
	}
	tests := []struct {
		name string
		req  *Request
		want string
	}{
		{"injected", &Request{Body: []byte(`{"x":1}`), InjectedCacheSalt: "inj"}, "inj"},
		{"body only", &Request{Body: []byte(`{"prompt":"p","cache_salt":"b"}`)}, "b"},
		{"body only, escaped key", &Request{Body: []byte(`{"prompt":"p","cache\u005fsalt":"e"}`)}, "e"},
		{"body only, case differs", &Request{Body: []byte(`{"prompt":"p","Cache_Salt":"no"}`)}, ""},
		{"body only, last wins", &Request{Body: []byte(`{"cache_salt":"a","cache_salt":"z"}`)}, "z"},
		{"body only, not a string", &Request{Body: []byte(`{"prompt":"p","cache_salt":5}`)}, ""},
		{"body only, nested", &Request{Body: []byte(`{"prompt":"p","x":{"cache_salt":"n"}}`)}, ""},
		{"body only, none", &Request{Body: []byte(`{"prompt":"p \u00e9"}`)}, ""},
		{"body only, salted head", &Request{Body: []byte(`{"cache_salt":"h_1","prompt":"p"}`)}, "h_1"},
	}
	for _, body := range []string{
		`{"prompt":"p","cache_salt":"b\u00e9"}`, `{"prompt":"p","Cache_Salt":"no"}`, `{"prompt":"p","cache_salt":"a","cache_salt":"z"}`,
		`{"prompt":"p","cache_salt":5}`, `{"prompt":"p","cache_salt":null}`, `{"prompt":"p"}`,
	} {
		b := []byte(body)
		var want string
		if !strings.Contains(body, "Cache_Salt") {
			var v struct {
				S any `json:"cache_salt"`
			}
			_ = json.Unmarshal(b, &v)
			want, _ = v.S.(string)
		}
		tests = append(tests, struct {
			name string
			req  *Request
			want string
		}{"parsed " + body, &Request{Body: b, Parsed: parse(body)}, want})
	}
	// A Parsed whose body was since rewritten (a salt injected without
	// InjectedCacheSalt) is not trusted: the new body's salt counts.
	orig := []byte(`{"prompt":"p","cache_salt":"client"}`)
	salted, err := openai.InjectCacheSalt(orig, "server", true)
	if err != nil {
		t.Fatal(err)
	}
	tests = append(tests, struct {
		name string
		req  *Request
		want string
	}{"parsed, body rewritten", &Request{Body: salted, Parsed: parse(string(orig))}, "server"})
	for _, tc := range tests {
		if got := tc.req.CacheSalt(); got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestSaltRequestBody: the salt written is reported; a body left as it
// was reports none.
func TestSaltRequestBody(t *testing.T) {
	on := &config.CacheSaltConfig{Enabled: true}
	keep := &config.CacheSaltConfig{Enabled: true, Client: config.CacheSaltKeep}
	want := DeriveCacheSalt(testSaltSecret, "t")
	tests := []struct {
		name     string
		c        *config.CacheSaltConfig
		tenant   string
		body     string
		wantSalt string
	}{
		{"salted", on, "t", `{"prompt":"p"}`, want},
		{"overwrites", on, "t", `{"prompt":"p","cache_salt":"c"}`, want},
		{"keeps the client's", keep, "t", `{"prompt":"p","cache_salt":"c"}`, ""},
		{"no tenant", on, "", `{"prompt":"p"}`, ""},
		{"off", nil, "t", `{"prompt":"p"}`, ""},
	}
	for _, tc := range tests {
		body := []byte(tc.body)
		out, salt, _ := saltRequestBody(tc.c, testSaltSecret, tc.tenant, body)
		if salt != tc.wantSalt {
			t.Errorf("%s: salt %q, want %q", tc.name, salt, tc.wantSalt)
		}
		if !bytes.Equal(out, saltBody(tc.c, testSaltSecret, tc.tenant, body)) {
			t.Errorf("%s: body differs from saltBody's", tc.name)
		}
		req := &Request{Body: out, InjectedCacheSalt: salt}
		if got, scanned := req.CacheSalt(), (&Request{Body: out}).CacheSalt(); got != scanned {
			t.Errorf("%s: recorded salt %q, body's %q", tc.name, got, scanned)
		}
	}
}

// FuzzCacheSalt: the salt kv_aware keys by is the same whether read from
// the parsed request or scanned from the body, and is encoding/json's
// wherever the two agree on keys (no case-folded or repeated key).
func FuzzCacheSalt(f *testing.F) {
	for _, s := range []string{
		`{"cache_salt":"abc","model":"m"}`, `{"model":"m","cache_salt":"a\u00e9"}`, `{"Cache_Salt":"x"}`,
		`{"cache_salt":"a","cache_salt":"b"}`, `{"cache\u005fsalt":"e"}`, `{"cache_salt":[1]}`, `{"x":{"cache_salt":"n"}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		scanned := (&Request{Body: body}).CacheSalt()
		parsed, err := ParseOpenAI(EndpointInvoke, body)
		if err != nil {
			return
		}
		if once := (&Request{Body: body, Parsed: parsed}).CacheSalt(); once != scanned {
			t.Fatalf("%q: parsed %q, scanned %q", body, once, scanned)
		}
		if !routertest.ComparableWithStd(body) {
			return
		}
		var v struct {
			S any `json:"cache_salt"`
		}
		if json.Unmarshal(body, &v) == nil {
			if want, _ := v.S.(string); want != scanned {
				t.Fatalf("%q: got %q, encoding/json %q", body, scanned, want)
			}
		}
	})
}

// saltBody is saltRequestBody's body, for tests that only look at the
// body: with the tenant's derived cache_salt when the pool asks for it and
// the request has a tenant key; else body itself (nil: refused).
func saltBody(c *config.CacheSaltConfig, secret []byte, tenant string, body []byte) []byte {
	out, _, _ := saltRequestBody(c, secret, tenant, body)
	return out
}
