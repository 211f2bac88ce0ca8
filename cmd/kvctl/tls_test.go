package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log"
	"math/big"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// writePEM writes one PEM block to a file in dir and returns its path.
func writePEM(t *testing.T, dir, name, typ string, der []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// An admin listener with mutual TLS (the router's client_ca_file): kvctl
// reaches it with --ca (the server's CA) and --cert/--key (a certificate
// the listener's client CA signed); without them it is refused.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvctl test client CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	clientCert := writePEM(t, dir, "client.pem", "CERTIFICATE", der)
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	clientKey := writePEM(t, dir, "client-key.pem", "EC PRIVATE KEY", kder)
	ca, _ := x509.ParseCertificate(der)
	clients := x509.NewCertPool()
	clients.AddCert(ca)

	tr := newTestRouter(t, 1, false, nil)
	srv := httptest.NewUnstartedServer(tr.srv.AdminHandler())
	srv.TLS = &tls.Config{ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: clients, MinVersion: tls.VersionTLS12}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes
	srv.StartTLS()
	t.Cleanup(srv.Close)
	serverCA := writePEM(t, dir, "server-ca.pem", "CERTIFICATE", srv.Certificate().Raw)

	run := func(args ...string) (int, string, string) {
		return runCLI(t, append([]string{"instances", "--router", srv.URL, "--timeout", "5s"}, args...)...)
	}
	if code, _, errOut := run(); code == 0 || !strings.Contains(errOut, "certificate") {
		t.Errorf("without --ca: exit %d, %s", code, errOut)
	}
	if code, _, errOut := run("--ca", serverCA); code == 0 {
		t.Errorf("without a client certificate: exit %d, %s", code, errOut)
	}
	if code, out, errOut := run("--ca", serverCA, "--cert", clientCert, "--key", clientKey); code != 0 || !strings.Contains(out, "llama") {
		t.Errorf("with --ca, --cert and --key: exit %d, %s%s", code, out, errOut)
	}
	if code, _, errOut := run("--ca", serverCA, "--cert", clientCert); code == 0 || !strings.Contains(errOut, "--cert and --key go together") {
		t.Errorf("--cert without --key: exit %d, %s", code, errOut)
	}
	if code, _, errOut := run("--ca", clientKey); code == 0 || !strings.Contains(errOut, "no PEM certificate") {
		t.Errorf("--ca holding no certificate: exit %d, %s", code, errOut)
	}
}
