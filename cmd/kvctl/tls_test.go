package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// An admin listener with mutual TLS (the router's client_ca_file): kvctl
// reaches it with --ca (the server's CA) and --cert/--key (a certificate
// the listener's client CA signed); without them it is refused.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ca := testenv.NewCA(t, "kvctl test client CA")
	certPEM, keyPEM := ca.Issue(t, "kvctl", 2, false)
	clientCert, clientKey := write("client.pem", certPEM), write("client-key.pem", keyPEM)
	clients := x509.NewCertPool()
	clients.AddCert(ca.Cert)

	tr := newTestRouter(t, 1, false, nil)
	srv := httptest.NewUnstartedServer(tr.srv.AdminHandler())
	srv.TLS = &tls.Config{ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: clients, MinVersion: tls.VersionTLS12}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes
	srv.StartTLS()
	t.Cleanup(srv.Close)
	serverCA := write("server-ca.pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}))

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
