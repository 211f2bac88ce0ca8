package config

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

func TestCacheSaltConfigValidate(t *testing.T) {
	tests := []struct {
		name   string
		cfg    *CacheSaltConfig
		secret []byte
		ok     bool
	}{
		{"nil", nil, nil, true},
		{"disabled needs no secret", &CacheSaltConfig{Client: CacheSaltKeep}, nil, true},
		{"enabled needs a secret", &CacheSaltConfig{Enabled: true}, nil, false},
		{"enabled with secret", &CacheSaltConfig{Enabled: true}, testSaltSecret, true},
		{"unknown client policy", &CacheSaltConfig{Client: "merge"}, testSaltSecret, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.validate("pools[0].cache_salt", tc.secret)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

var testSaltSecret = []byte("0123456789abcdef0123456789abcdef")

// DecodeCacheSaltSecret never panics; it accepts exactly the hex strings
// (spaces around allowed) of at least the minimum length, returns their
// bytes, and says ErrCacheSalt for everything else.
func FuzzDecodeCacheSaltSecret(f *testing.F) {
	for _, s := range []string{"", "  ", "00", strings.Repeat("ab", MinCacheSaltSecretBytes), " " + strings.Repeat("AB", MinCacheSaltSecretBytes+1) + "\n", strings.Repeat("zz", MinCacheSaltSecretBytes), strings.Repeat("a", 2*MinCacheSaltSecretBytes+1)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := DecodeCacheSaltSecret(s)
		trimmed := strings.TrimSpace(s)
		want, herr := hex.DecodeString(trimmed)
		switch {
		case trimmed == "":
			if b != nil || err != nil {
				t.Fatalf("%q: %x, %v; want no secret", s, b, err)
			}
		case herr != nil || len(want) < MinCacheSaltSecretBytes:
			if err == nil || !errors.Is(err, ErrCacheSalt) {
				t.Fatalf("%q: accepted %x (%v)", s, b, err)
			}
		case err != nil || string(b) != string(want):
			t.Fatalf("%q: %x, %v; want %x", s, b, err, want)
		}
	})
}
