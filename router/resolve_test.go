package router_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

func TestLimitsConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		l    config.LimitsConfig
		want string // "" = valid
	}{
		{"defaults", config.LimitsConfig{}, ""},
		{"header too small", config.LimitsConfig{MaxHeaderBytes: 100}, "limits.max_header_bytes 100 out of range"},
		{"negative messages", config.LimitsConfig{MaxMessages: -1}, "limits.max_messages"},
		{"negative token ids", config.LimitsConfig{MaxPromptTokenIDs: -5}, "limits.max_prompt_token_ids"},
		{"tokenize above the token source's bound", config.LimitsConfig{MaxTokenizeBytes: config.MaxTokenizeBytes + 1}, "limits.max_tokenize_bytes"},
		{"negative timeout", config.LimitsConfig{BodyReadTimeout: -time.Second}, "timeouts"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.l.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, config.ErrInvalidConfig) {
				t.Fatalf("err = %v, want ErrInvalidConfig mentioning %q", err, tc.want)
			}
		})
	}
	d := config.LimitsConfig{}.WithDefaults()
	if d.MaxHeaderBytes != 64<<10 || d.MaxMessages != 4096 || d.MaxPromptTokenIDs != 1<<20 || d.MaxTokenizeBytes != config.MaxTokenizeBytes ||
		d.ReadHeaderTimeout != 10*time.Second || d.BodyReadTimeout != time.Minute || d.IdleTimeout != 2*time.Minute {
		t.Fatalf("defaults %+v", d)
	}
}

func TestSecurityConfigFromYAML(t *testing.T) {
	base := "pools:\n  - name: p\n    model: m\n    instances: [{id: a, url: 'http://127.0.0.1:1'}]\n"
	tests := []struct {
		name, yaml string
		secret     []byte
		want       string // "" = valid
	}{
		{"limits section", "limits: {max_messages: 10, max_header_bytes: 4096, body_read_timeout: 5s}\n" + base, nil, ""},
		{"body memory of 3 x max_body_bytes", "max_body_bytes: 1048576\nlimits: {max_body_memory_bytes: 3145728}\n" + base, nil, ""},
		{"body memory below 3 x max_body_bytes", "max_body_bytes: 1048576\nlimits: {max_body_memory_bytes: 3145727}\n" + base, nil, "limits.max_body_memory_bytes 3145727 out of range 3145728"},
		{"tls needs both files", "tls: {cert_file: /x.crt}\n" + base, nil, "tls: cert_file and key_file are both required"},
		{"tls min version", "tls: {cert_file: /x.crt, key_file: /x.key, min_version: '1.0'}\n" + base, nil, "tls.min_version"},
		{"cache_salt needs the secret", base + "    cache_salt: {enabled: true}\n", nil, "pools[0].cache_salt.enabled needs the secret in KVROUTER_CACHE_SALT_SECRET"},
		{"cache_salt with the secret", base + "    cache_salt: {enabled: true, client: keep}\n", make([]byte, 16), ""},
		{"cache_salt bad client policy", base + "    cache_salt: {enabled: true, client: merge}\n", make([]byte, 16), "pools[0].cache_salt.client"},
		{"secret is not a file field", "cache_salt_secret: abc\n" + base, nil, "cache_salt_secret"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.ParseConfig(strings.NewReader(tc.yaml))
			if err == nil {
				cfg.CacheSaltSecret = tc.secret
				err = cfg.WithDefaults().Validate()
			}
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

// TestTokenizeLimitRoutesHeuristically: a body over max_tokenize_bytes is
// never handed to the tokenizer; the request still routes.
func TestTokenizeLimitRoutesHeuristically(t *testing.T) {
	req := &router.Request{Body: make([]byte, 100)}
	router.LimitTokenizeForTest(config.LimitsConfig{MaxTokenizeBytes: 99}, req)
	if _, err := req.TokenIDs(context.Background()); !errors.Is(err, router.ErrPromptTooLong) || !errors.Is(err, router.ErrTokenSource) {
		t.Fatalf("over the limit: err %v, want ErrPromptTooLong", err)
	}
	req = &router.Request{Body: make([]byte, 99)}
	router.LimitTokenizeForTest(config.LimitsConfig{MaxTokenizeBytes: 99}, req)
	if req.Tokenizer != nil {
		t.Fatal("a body at the limit lost its tokenizer")
	}
	req = &router.Request{Body: make([]byte, 100), PromptTokens: []uint32{1}}
	router.LimitTokenizeForTest(config.LimitsConfig{MaxTokenizeBytes: 99}, req)
	if ids, err := req.TokenIDs(context.Background()); err != nil || len(ids) != 1 {
		t.Fatalf("given token ids: %v %v", ids, err)
	}
}
