package config

import (
	"crypto/tls"
	"fmt"
	"time"
)

// ServerTLSConfig is the tls: section: TLS for the HTTP listeners (data
// plane and admin). The certificate files are re-read on SIGHUP and when
// they change on disk (cert-manager and Kubernetes secret volumes rotate
// them in place), without dropping connections.
type ServerTLSConfig struct {
	// CertFile is the PEM certificate chain (leaf first).
	CertFile string `yaml:"cert_file" json:"cert_file"`
	// KeyFile is the PEM private key of the leaf.
	KeyFile string `yaml:"key_file" json:"key_file"`
	// ClientCAFile, when set, turns on mutual TLS: clients must present a
	// certificate signed by one of these CAs (PEM bundle).
	ClientCAFile string `yaml:"client_ca_file" json:"client_ca_file,omitempty"`
	// MinVersion: "1.2" or "1.3". Default 1.2 (1.0 and 1.1 are deprecated
	// by RFC 8996).
	MinVersion string `yaml:"min_version" json:"min_version,omitempty"`
	// ReloadInterval: how often the files are checked for changes.
	// Default 30s; negative = only on SIGHUP.
	ReloadInterval time.Duration `yaml:"reload_interval" json:"reload_interval,omitempty"`
}

// DefaultTLSReloadInterval is how often certificate files are re-read by default.
const DefaultTLSReloadInterval = 30 * time.Second

// Validate checks the section; field is its YAML path.
func (c *ServerTLSConfig) Validate(field string) error {
	if c == nil {
		return nil
	}
	if c.CertFile == "" || c.KeyFile == "" {
		return fmt.Errorf("%w: %s: cert_file and key_file are both required", ErrInvalidConfig, field)
	}
	if _, err := TLSMinVersion(c.MinVersion); err != nil {
		return fmt.Errorf("%w: %s.min_version: %w", ErrInvalidConfig, field, err)
	}
	return nil
}

func TLSMinVersion(s string) (uint16, error) {
	switch s {
	case "", "1.2":
		return tls.VersionTLS12, nil
	case "1.3":
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("%q: want 1.2 or 1.3", s)
}
