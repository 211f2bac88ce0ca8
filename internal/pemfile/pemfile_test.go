package pemfile

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// files writes a self-signed certificate, its key and a file with no
// certificate into a temporary directory.
func files(t *testing.T) (cert, key, junk string) {
	t.Helper()
	dir := t.TempDir()
	cert, key, _ = testenv.SelfSigned(t, dir)
	junk = filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(junk, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return cert, key, junk
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
