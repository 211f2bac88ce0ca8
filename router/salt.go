package router

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Per-tenant cache salts.
//
// Routing tenants apart does not keep their KV caches apart: a tenant whose
// requests land on an instance (overflow, retries, a strategy switch) can
// time its own requests and learn whether another tenant's prompt prefix is
// cached there. vLLM closes that side channel with the request field
// "cache_salt": the engine folds it into the hash of the prompt's first
// block, so only requests with the same salt share prefix-cache blocks
// (vLLM docs, "Automatic Prefix Caching" / "Cache salting", and the
// prefix-caching design doc's "cache_salt" section). A pool with
// cache_salt.enabled derives the salt from the tenant key with a
// server-side secret and writes it into the forwarded body, so clients
// need not (and, by default, cannot) choose it.

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
var ErrCacheSalt = errors.New("router: cache salt")

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

// cacheSaltDomain separates these HMACs from any other use of the secret.
const cacheSaltDomain = "kvrouter cache_salt v1\x00"

// DeriveCacheSalt is the salt of a tenant: base64url (no padding) of
// HMAC-SHA256(secret, domain || tenant). Equal tenants get equal salts on
// every router replica sharing the secret; without the secret a salt can
// neither be computed nor guessed (256 bits).
func DeriveCacheSalt(secret []byte, tenant string) string {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(cacheSaltDomain))
	m.Write([]byte(tenant))
	var sum [sha256.Size]byte
	return base64.RawURLEncoding.EncodeToString(m.Sum(sum[:0]))
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

// saltRequestBody returns the body to forward for a request of the pool and
// the salt it wrote: the tenant's derived cache_salt when the pool asks for
// it, the request has a tenant key and the body is a JSON object; else body
// itself and "" (a body that is not a JSON object — raw invoke payloads may
// be anything — is forwarded unchanged). The salt is for
// Request.InjectedCacheSalt:
//
//	req.Body, req.InjectedCacheSalt = saltRequestBody(...)
//
// spares kv_aware reading the salt back out of the new body.
func saltRequestBody(c *CacheSaltConfig, secret []byte, tenant string, body []byte) ([]byte, string) {
	if c == nil || !c.Enabled || tenant == "" || len(secret) == 0 {
		return body, ""
	}
	salt := DeriveCacheSalt(secret, tenant)
	out, err := InjectCacheSalt(body, salt, c.Client != CacheSaltKeep)
	if err != nil || sameBytes(out, body) {
		return body, "" // not an object, or a client salt kept
	}
	return out, salt
}

// scanCacheSalt reads the top-level "cache_salt" string of a JSON object
// body (the last one when repeated, as Python's json keeps), with exact key
// match: "" when there is none, it is not a string, or body is not an object.
func scanCacheSalt(body []byte) string {
	salt, _ := rawString(topLevelRaw(body, "cache_salt"))
	return salt
}

// errNotObject: the body is not one JSON object.
var errNotObject = errors.New("not a JSON object")

// InjectCacheSalt returns a copy of the JSON object body with the top-level
// member "cache_salt" set to salt. An existing cache_salt member is replaced when
// overwrite is true (every copy of it: parsers differ on which duplicate
// wins), else the body is returned as is. Other members keep their bytes
// and order; whitespace between top-level members is dropped.
func InjectCacheSalt(body []byte, salt string, overwrite bool) ([]byte, error) {
	s := &jscan{b: body}
	if s.peek() != '{' {
		return nil, errNotObject
	}
	type span struct{ start, end int }
	var keep []span // members other than cache_salt
	found := false
	s.i++
	if s.peek() == '}' {
		s.i++
	} else {
		for {
			s.ws()
			start := s.i
			raw, esc, err := s.str()
			if err != nil {
				return nil, err
			}
			if err := s.expect(':'); err != nil {
				return nil, err
			}
			if _, err := s.skip(1); err != nil {
				return nil, err
			}
			if unquote(raw, esc) == "cache_salt" {
				found = true
			} else {
				keep = append(keep, span{start, s.i})
			}
			if s.peek() == ',' {
				s.i++
				continue
			}
			if err := s.expect('}'); err != nil {
				return nil, err
			}
			break
		}
	}
	if s.peek() != 0 || s.i < len(s.b) {
		return nil, s.errorf("invalid character after top-level value")
	}
	if found && !overwrite {
		return body, nil
	}
	q, err := json.Marshal(salt)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(body)+len(q)+16)
	out = append(out, `{"cache_salt":`...)
	out = append(out, q...)
	for _, m := range keep {
		out = append(out, ',')
		out = append(out, body[m.start:m.end]...)
	}
	return append(out, '}'), nil
}

// leadingCacheSalt reads the salt InjectCacheSalt wrote: a body that opens
// with {"cache_salt":"<base64url>" and mentions no other "cache_salt". It
// spares kv_aware a full JSON decode of long bodies (650 µs at 256 KiB);
// ok is false for any other shape, which then takes the general path.
func leadingCacheSalt(body []byte) (salt string, ok bool) {
	const head = `{"cache_salt":"`
	if !bytes.HasPrefix(body, []byte(head)) {
		return "", false
	}
	i := len(head)
	for i < len(body) && isSaltByte(body[i]) {
		i++
	}
	if i+1 >= len(body) || body[i] != '"' || (body[i+1] != ',' && body[i+1] != '}') {
		return "", false
	}
	if bytes.Contains(body[i:], []byte(`"cache_salt"`)) || bytes.Contains(body[i:], []byte(`\u`)) {
		return "", false // a duplicate (last one wins) or an escaped key: decode
	}
	return string(body[len(head):i]), true
}

func isSaltByte(c byte) bool {
	return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// TenantCacheSalt is the cache_salt the router injects for tenant's
// requests to pool: ok is false when the pool does not salt (no such pool,
// cache_salt off, or no tenant). For APIs that pick without forwarding
// (gRPC Pick and Lookup, the admin lookup), so that they key blocks as the
// forwarded requests will.
func (s *Server) TenantCacheSalt(pool, tenant string) (salt string, ok bool) {
	st := s.state.Load()
	p := st.byName[pool]
	if p == nil || tenant == "" || p.cfg.CacheSalt == nil || !p.cfg.CacheSalt.Enabled || len(st.cfg.CacheSaltSecret) == 0 {
		return "", false
	}
	return DeriveCacheSalt(st.cfg.CacheSaltSecret, tenant), true
}
