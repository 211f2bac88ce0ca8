package pemfile

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// files writes a self-signed certificate, its key and a file with no
// certificate into a temporary directory.
func files(t *testing.T) (cert, key, junk string) {
	t.Helper()
	dir := t.TempDir()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "pemfile test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return write("c.pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})),
		write("k.pem", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})),
		write("junk.pem", []byte("not a certificate\n"))
}

func TestCertPool(t *testing.T) {
	cert, key, junk := files(t)
	if _, err := CertPool(cert); err != nil {
		t.Fatalf("a certificate: %v", err)
	}
	for _, p := range []string{key, junk} {
		if _, err := CertPool(p); !errors.Is(err, ErrNoCertificate) {
			t.Errorf("%s: %v, want ErrNoCertificate", filepath.Base(p), err)
		}
	}
	if _, err := CertPool(filepath.Join(t.TempDir(), "missing.pem")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a missing file: %v", err)
	}
}

func TestClientTLS(t *testing.T) {
	cert, key, junk := files(t)
	cfg, err := ClientTLS("", "", "")
	if err != nil || cfg.RootCAs != nil || len(cfg.Certificates) != 0 {
		t.Fatalf("nothing given: %+v %v", cfg, err)
	}
	cfg, err = ClientTLS(cert, cert, key)
	if err != nil || cfg.RootCAs == nil || len(cfg.Certificates) != 1 {
		t.Fatalf("CA, certificate and key: %v", err)
	}
	if _, err := ClientTLS("", cert, ""); err == nil {
		t.Error("a certificate without its key accepted")
	}
	if _, err := ClientTLS(junk, "", ""); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("a CA file with no certificate: %v", err)
	}
	if _, err := ClientTLS("", cert, junk); err == nil {
		t.Error("a key file holding no key accepted")
	}
}
