package router

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/openai"
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
// it and the request has a tenant key; else body itself and "". A body the
// salt must go into that is not one strict JSON object is refused
// (NotJSONObject): forwarded unsalted, a body that vLLM's parser reads
// (NaN, a BOM, UTF-16) would keep the client's own cache_salt. The salt is
// for Request.InjectedCacheSalt:
//
//	req.Body, req.InjectedCacheSalt, err = saltRequestBody(...)
//
// spares kv_aware reading the salt back out of the new body.
func saltRequestBody(c *config.CacheSaltConfig, secret []byte, tenant string, body []byte) ([]byte, string, error) {
	if c == nil || !c.Enabled || tenant == "" || len(secret) == 0 {
		return body, "", nil
	}
	salt := DeriveCacheSalt(secret, tenant)
	out, err := openai.InjectCacheSalt(body, salt, c.Client != config.CacheSaltKeep)
	if err != nil {
		return nil, "", NotJSONObject(err)
	}
	if sameBytes(out, body) {
		return body, "", nil // a client salt kept
	}
	return out, salt, nil
}

// NotJSONObject is the 400 of a body the router must rewrite (remove
// kv_transfer_params, write cache_salt) but cannot read as one strict JSON
// object. vLLM reads bodies with Python's json.loads, which takes more:
// NaN and Infinity, a UTF-8 BOM, UTF-16 and UTF-32. Forwarded unread, such
// a body would reach the engine with the members the router is there to
// remove or replace.
func NotJSONObject(err error) *RequestError {
	return badRequest("body must be a JSON object (strict JSON: no NaN/Infinity, UTF-8 without BOM): %v", err)
}

// TenantCacheSalt is the cache_salt the router injects for tenant's
// requests to pool: ok is false when the pool does not salt (no such pool,
// cache_salt off, or no tenant). For APIs that pick without forwarding
// (gRPC Pick and Lookup, the admin lookup), so that they key blocks as the
// forwarded requests will.
func (st *Table) TenantCacheSalt(pool, tenant string) (salt string, ok bool) {
	p := st.byName[pool]
	if p == nil || tenant == "" || p.cfg.CacheSalt == nil || !p.cfg.CacheSalt.Enabled || len(st.cfg.CacheSaltSecret) == 0 {
		return "", false
	}
	return DeriveCacheSalt(st.cfg.CacheSaltSecret, tenant), true
}

// CacheSalt returns the request's "cache_salt" (vLLM's per-request KV
// isolation key, folded into the first block's hash by the engine, hence
// into our root), without reading the body when it can: the salt the
// router injected, else the one ParseOpenAI kept, else the one the router
// wrote at the head of the body (salt.go); only other shapes are scanned.
// Keys match exactly, as vLLM's do: "Cache_Salt" is not cache_salt.
func (req *Request) CacheSalt() string {
	if req.InjectedCacheSalt != "" {
		return req.InjectedCacheSalt
	}
	if p := req.Parsed; p != nil && sameBytes(p.Source(), req.Body) {
		salt, _ := openai.RawString(p.CacheSalt) // not a string: no salt, as before
		return salt
	}
	if salt, ok := openai.LeadingCacheSalt(req.Body); ok {
		return salt // as the router injected it (salt.go): no decode
	}
	if !bytes.Contains(req.Body, []byte(`"cache_salt"`)) && !bytes.Contains(req.Body, []byte(`\u`)) {
		return "" // no key that could decode to cache_salt
	}
	return openai.CacheSalt(req.Body)
}

// sameBytes reports whether a and b are the same slice of memory.
func sameBytes(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}
