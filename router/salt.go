package router

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"

	"github.com/kvrouter/kvrouter/config"
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
func saltRequestBody(c *config.CacheSaltConfig, secret []byte, tenant string, body []byte) ([]byte, string) {
	if c == nil || !c.Enabled || tenant == "" || len(secret) == 0 {
		return body, ""
	}
	salt := DeriveCacheSalt(secret, tenant)
	out, err := InjectCacheSalt(body, salt, c.Client != config.CacheSaltKeep)
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
