package config

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

// CacheSaltSecretEnv holds the hex-encoded HMAC key of cache salts.
const CacheSaltSecretEnv = "KVROUTER_CACHE_SALT_SECRET"

// MinCacheSaltSecretBytes is the shortest secret accepted: 128 bits, so
// that salts cannot be guessed by brute force.
const MinCacheSaltSecretBytes = 16

// Cache salt client policies (pools[].cache_salt.client).
const (
	// CacheSaltOverwrite replaces a client's own cache_salt with the derived
	// one whenever the request has a tenant key, so a tenant cannot pick a
	// salt to share another tenant's cache. The default.
	CacheSaltOverwrite = "overwrite"
	// CacheSaltKeep forwards a client's own cache_salt untouched and only
	// adds the derived one to requests that carry none.
	CacheSaltKeep = "keep"
)

// ErrCacheSalt reports a cache_salt configuration or secret that cannot be used.
var ErrCacheSalt = errors.New("config: cache salt")

// CacheSaltConfig is a pool's cache_salt section.
type CacheSaltConfig struct {
	// Enabled derives a salt from the tenant key (header, else
	// prompt_cache_key) and injects it into forwarded JSON bodies as
	// "cache_salt". Requests without a tenant key are forwarded unchanged.
	// Needs KVROUTER_CACHE_SALT_SECRET.
	Enabled bool `yaml:"enabled" json:"enabled,omitempty"`
	// Client: what happens to a cache_salt the client sent, on requests
	// with a tenant key: overwrite (default) or keep.
	Client string `yaml:"client" json:"client,omitempty"`
}

// DecodeCacheSaltSecret decodes the hex secret from KVROUTER_CACHE_SALT_SECRET.
// Empty means no secret (nil, nil); pools that enable cache_salt then fail
// validation.
func DecodeCacheSaltSecret(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	b, err := hex.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: want hex: %w", ErrCacheSalt, CacheSaltSecretEnv, err)
	}
	if len(b) < MinCacheSaltSecretBytes {
		return nil, fmt.Errorf("%w: %s: %d bytes, want at least %d (e.g. openssl rand -hex 32)", ErrCacheSalt, CacheSaltSecretEnv, len(b), MinCacheSaltSecretBytes)
	}
	return b, nil
}

// validate checks a pool's cache_salt section against the secret.
func (c *CacheSaltConfig) validate(field string, secret []byte) error {
	if c == nil {
		return nil
	}
	switch c.Client {
	case "", CacheSaltOverwrite, CacheSaltKeep:
	default:
		return fmt.Errorf("%w: %s.client %q: want %s or %s", ErrInvalidConfig, field, c.Client, CacheSaltOverwrite, CacheSaltKeep)
	}
	if c.Enabled && len(secret) < MinCacheSaltSecretBytes {
		return fmt.Errorf("%w: %s.enabled needs the secret in %s (hex, at least %d bytes)", ErrInvalidConfig, field, CacheSaltSecretEnv, MinCacheSaltSecretBytes)
	}
	return nil
}
