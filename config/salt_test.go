package config

import (
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
