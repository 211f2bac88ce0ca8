// Package pemfile reads the PEM files that TLS settings name: a CA bundle
// into a certificate pool, and a client's CA, certificate and key into a
// tls.Config. Callers prefix errors with the setting that named the file.
package pemfile

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// ErrNoCertificate: the file holds no PEM certificate.
var ErrNoCertificate = errors.New("no PEM certificate in it")

// CertPool reads the PEM certificates of the file at path into a new pool.
func CertPool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("%s: %w", path, ErrNoCertificate)
	}
	return pool, nil
}

// ClientTLS is a TLS client's configuration (TLS 1.2 at least): servers
// verified against the CA file's certificates (empty: the system's), and
// the certificate and key presented when a server asks for one (both
// files, or neither).
func ClientTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("a client certificate and its key go together")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := CertPool(caFile)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = pool
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}
