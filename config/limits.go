package config

import (
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// LimitsConfig is the limits: section: bounds on every client input beside
// max_body_bytes. Zero fields mean the defaults below; each limit answers
// with an OpenAI-shaped error (see docs/security.md for the table).
type LimitsConfig struct {
	// MaxHeaderBytes bounds the request line plus headers: above it the
	// router answers 431 (OpenAI-shaped). Default 64 KiB. net/http itself
	// cuts connections at twice this (plus its 4 KiB slack) with a plain
	// 431, so that a huge header is never buffered.
	MaxHeaderBytes int `yaml:"max_header_bytes" json:"max_header_bytes,omitempty"`
	// MaxMessages bounds a chat request's messages (400 above). Default 4096.
	MaxMessages int `yaml:"max_messages" json:"max_messages,omitempty"`
	// MaxContentParts bounds the parts of a chat request's array contents,
	// all messages together (400 above). Default 8192 (DefaultMaxContentParts).
	MaxContentParts int `yaml:"max_content_parts" json:"max_content_parts,omitempty"`
	// MaxPromptTokenIDs bounds the token ids of a completions prompt given
	// as ids, all sequences together (400 above). Default 1,048,576.
	MaxPromptTokenIDs int `yaml:"max_prompt_token_ids" json:"max_prompt_token_ids,omitempty"`
	// MaxPrompts bounds the prompts of a completions prompt given as a list
	// of strings or of token-id lists (400 above). Default 4096 (DefaultMaxPrompts).
	MaxPrompts int `yaml:"max_prompts" json:"max_prompts,omitempty"`
	// MaxTokenizeBytes: bodies larger than this are not tokenized for
	// kv_aware routing; they route heuristically (prefix_aware) rather than
	// being rejected, since the engine, not the router, knows the model's
	// context length. Default and maximum 4 MiB (MaxTokenizeBytes).
	MaxTokenizeBytes int `yaml:"max_tokenize_bytes" json:"max_tokenize_bytes,omitempty"`
	// ReadHeaderTimeout bounds reading a request's headers (slow-loris).
	// Default 10s.
	ReadHeaderTimeout time.Duration `yaml:"read_header_timeout" json:"read_header_timeout,omitempty"`
	// BodyReadTimeout bounds reading a request's body, from the end of its
	// headers (a client trickling a 32 MiB body holds a goroutine and the
	// buffer). Default 60s. Past it the request fails with 408.
	BodyReadTimeout time.Duration `yaml:"body_read_timeout" json:"body_read_timeout,omitempty"`
	// IdleTimeout closes keep-alive connections idle this long. Default 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout" json:"idle_timeout,omitempty"`
	// MaxBodyMemoryBytes bounds the memory all request bodies in progress
	// hold together (router/httpapi/body.go): past it a request is answered 503
	// with Retry-After rather than read. Default 128 MiB, or 4 x
	// max_body_bytes when that is larger; at least 3 x max_body_bytes (a
	// body of the limit read without a Content-Length briefly needs twice
	// its size, within the three quarters of the budget large bodies may
	// use).
	MaxBodyMemoryBytes int64 `yaml:"max_body_memory_bytes" json:"max_body_memory_bytes,omitempty"`
}

// Limit defaults (docs/security.md).
const (
	DefaultMaxHeaderBytes    = 64 << 10
	DefaultMaxMessages       = 4096
	DefaultMaxPromptTokenIDs = 1 << 20
	// DefaultMaxPrompts, as max_messages: a list prompt is a batch of
	// sequences, each prefilled on its own and all routed by the first;
	// batches past thousands are better split into requests, which the
	// router can spread over instances. 4096 prompts are at most ~100 KiB
	// of slice headers beside their text.
	DefaultMaxPrompts = 4096
	// DefaultMaxContentParts is two parts a message at max_messages (a
	// text and an image is the usual content array). Each part is decoded
	// whole to find its text (300-500 bytes of heap a part, whatever its
	// size: a body of "{}," parts asks for one every three bytes): 8192
	// keeps that near the messages' own bound, ~4 MB a request.
	DefaultMaxContentParts   = 2 * DefaultMaxMessages
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultBodyReadTimeout   = 60 * time.Second
	DefaultIdleTimeout       = 2 * time.Minute
	// maxHeaderBytesCeiling keeps the configurable header limit sane: net/http
	// buffers up to twice the limit per connection.
	maxHeaderBytesCeiling = 16 << 20
)

// WithDefaults returns l with zero fields replaced by their defaults.
func (l LimitsConfig) WithDefaults() LimitsConfig {
	zero.Default(&l.MaxHeaderBytes, DefaultMaxHeaderBytes)
	zero.Default(&l.MaxMessages, DefaultMaxMessages)
	zero.Default(&l.MaxPromptTokenIDs, DefaultMaxPromptTokenIDs)
	zero.Default(&l.MaxPrompts, DefaultMaxPrompts)
	zero.Default(&l.MaxContentParts, DefaultMaxContentParts)
	zero.Default(&l.MaxTokenizeBytes, MaxTokenizeBytes)
	zero.Default(&l.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	zero.Default(&l.BodyReadTimeout, DefaultBodyReadTimeout)
	zero.Default(&l.IdleTimeout, DefaultIdleTimeout)
	return l
}

// Validate checks l (after defaults), naming the field and its range.
func (l LimitsConfig) Validate() error {
	l = l.WithDefaults()
	bad := invalidf("limits.")
	switch {
	case l.MaxHeaderBytes < 1024 || l.MaxHeaderBytes > maxHeaderBytesCeiling:
		return bad("max_header_bytes %d out of range 1024..%d", l.MaxHeaderBytes, maxHeaderBytesCeiling)
	case l.MaxMessages < 1:
		return bad("max_messages %d: want >= 1", l.MaxMessages)
	case l.MaxPromptTokenIDs < 1:
		return bad("max_prompt_token_ids %d: want >= 1", l.MaxPromptTokenIDs)
	case l.MaxPrompts < 1:
		return bad("max_prompts %d: want >= 1", l.MaxPrompts)
	case l.MaxContentParts < 1:
		return bad("max_content_parts %d: want >= 1", l.MaxContentParts)
	case l.MaxTokenizeBytes < 1 || l.MaxTokenizeBytes > MaxTokenizeBytes:
		return bad("max_tokenize_bytes %d out of range 1..%d", l.MaxTokenizeBytes, MaxTokenizeBytes)
	case l.ReadHeaderTimeout < 0 || l.BodyReadTimeout < 0 || l.IdleTimeout < 0:
		return bad("timeouts must be > 0 (0 = default)")
	}
	return nil
}

// validateSecurity checks the limits, tls and cache_salt sections of c.
func (c Config) validateSecurity() error {
	if err := c.Limits.Validate(); err != nil {
		return err
	}
	if m := c.Limits.MaxBodyMemoryBytes; m != 0 && (m < 3*c.MaxBodyBytes || m > 1<<40) {
		return fmt.Errorf("%w: limits.max_body_memory_bytes %d out of range %d (3 x max_body_bytes)..%d", ErrInvalidConfig, m, 3*c.MaxBodyBytes, int64(1)<<40)
	}
	if err := c.TLS.Validate("tls"); err != nil {
		return err
	}
	for i, p := range c.Pools {
		if err := p.CacheSalt.validate(fmt.Sprintf("pools[%d].cache_salt", i), c.CacheSaltSecret); err != nil {
			return err
		}
	}
	return nil
}

// MaxTokenizeBytes caps the bodies a token source tokenizes: 4 MiB is
// about a million tokens of text, eight times a 128k-token context. A
// larger body routes heuristically rather than costing the router
// hundreds of milliseconds of CPU (the engine will reject it anyway).
const MaxTokenizeBytes = 4 << 20
