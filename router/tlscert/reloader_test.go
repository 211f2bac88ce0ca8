package tlscert

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

// testCA is a certificate authority made in the test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a PEM certificate and key for cn (a server for 127.0.0.1
// when server is true, else a client), with the given serial.
func (ca *testCA) issue(t *testing.T, cn string, serial int64, server bool) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// serveTLS serves h over TLS from r on a local port and returns its URL.
func serveTLS(t *testing.T, r *Reloader, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := httpapi.NewHTTPServer(config.LimitsConfig{}, h)
	hs.ErrorLog = log.New(io.Discard, "", 0) // handshake failures are the point of some tests
	go func() { _ = hs.Serve(tls.NewListener(ln, r.TLSConfig())) }()
	t.Cleanup(func() { _ = hs.Close() })
	return "https://" + ln.Addr().String()
}

func httpsClient(ca *testCA, cert *tls.Certificate) *http.Client {
	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	cfg := &tls.Config{RootCAs: roots}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg, DisableKeepAlives: true}}
}

func TestTLSServesHTTPSAndReloads(t *testing.T) {
	dir := t.TempDir()
	ca := newTestCA(t, "test ca")
	certF, keyF := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	c, k := ca.issue(t, "router", 100, true)
	writeFile(t, certF, c)
	writeFile(t, keyF, k)
	r, err := NewReloader(config.ServerTLSConfig{CertFile: certF, KeyFile: keyF, ReloadInterval: 20 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.Run(ctx)
	url := serveTLS(t, r, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }))
	client := httpsClient(ca, nil)
	serial := func() int64 {
		t.Helper()
		resp, err := client.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if string(b) != "ok" || resp.TLS == nil {
			t.Fatalf("body %q tls %v", b, resp.TLS != nil)
		}
		return resp.TLS.PeerCertificates[0].SerialNumber.Int64()
	}
	if s := serial(); s != 100 {
		t.Fatalf("serial %d, want 100", s)
	}

	// Plain HTTP to the TLS port fails rather than being served.
	if resp, err := http.Get(strings.Replace(url, "https", "http", 1)); err == nil {
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("plain HTTP answered %d", resp.StatusCode)
		}
		resp.Body.Close()
	}

	// A half-written rotation (new cert, old key) keeps the old pair.
	c2, k2 := ca.issue(t, "router", 200, true)
	writeFile(t, certF, c2)
	if _, err := r.Reload(); err == nil {
		t.Fatal("reload of a mismatched pair succeeded")
	}
	if s := serial(); s != 100 {
		t.Fatalf("after a failed reload serial %d, want 100", s)
	}
	// The key arrives: the file watch picks the new pair up.
	writeFile(t, keyF, k2)
	deadline := time.Now().Add(5 * time.Second)
	for serial() != 200 {
		if time.Now().After(deadline) {
			t.Fatal("the rotated certificate was not picked up")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if changed, err := r.Reload(); changed || err != nil {
		t.Fatalf("reload of unchanged files: changed=%v err=%v", changed, err)
	}
}

func TestTLSMutualRejectsUnknownClients(t *testing.T) {
	dir := t.TempDir()
	ca := newTestCA(t, "server ca")
	clientCA := newTestCA(t, "client ca")
	otherCA := newTestCA(t, "other ca")
	c, k := ca.issue(t, "router", 1, true)
	paths := map[string][]byte{"tls.crt": c, "tls.key": k, "clients.pem": clientCA.pem}
	for n, b := range paths {
		writeFile(t, filepath.Join(dir, n), b)
	}
	r, err := NewReloader(config.ServerTLSConfig{
		CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"),
		ClientCAFile: filepath.Join(dir, "clients.pem"), MinVersion: "1.3",
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	url := serveTLS(t, r, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.WriteString(w, req.TLS.PeerCertificates[0].Subject.CommonName)
	}))
	pair := func(ca *testCA) *tls.Certificate {
		cp, kp := ca.issue(t, "client of "+ca.cert.Subject.CommonName, 7, false)
		cert, err := tls.X509KeyPair(cp, kp)
		if err != nil {
			t.Fatal(err)
		}
		return &cert
	}
	tests := []struct {
		name string
		cert *tls.Certificate
		ok   bool
	}{
		{"no client certificate", nil, false},
		{"certificate from another CA", pair(otherCA), false},
		{"certificate from the client CA", pair(clientCA), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := httpsClient(ca, tc.cert).Get(url)
			if !tc.ok {
				if err == nil {
					resp.Body.Close()
					t.Fatalf("served with status %d", resp.StatusCode)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if string(b) != "client of client ca" || resp.TLS.Version != tls.VersionTLS13 {
				t.Fatalf("body %q version %x", b, resp.TLS.Version)
			}
		})
	}

	// min_version 1.3: a TLS 1.2-only client is refused.
	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	cl := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MaxVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*pair(clientCA)}}}}
	if resp, err := cl.Get(url); err == nil {
		resp.Body.Close()
		t.Fatal("a TLS 1.2 client was served with min_version 1.3")
	}
}

func TestNewCertReloaderErrors(t *testing.T) {
	dir := t.TempDir()
	ca := newTestCA(t, "ca")
	c, k := ca.issue(t, "router", 1, true)
	_, k2 := ca.issue(t, "router", 2, true)
	files := map[string][]byte{"c": c, "k": k, "k2": k2, "junk": []byte("not pem")}
	for n, b := range files {
		writeFile(t, filepath.Join(dir, n), b)
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	tests := []struct {
		name string
		cfg  config.ServerTLSConfig
		want string
	}{
		{"missing key_file", config.ServerTLSConfig{CertFile: p("c")}, "cert_file and key_file are both required"},
		{"bad min_version", config.ServerTLSConfig{CertFile: p("c"), KeyFile: p("k"), MinVersion: "1.1"}, "min_version"},
		{"cert file absent", config.ServerTLSConfig{CertFile: p("nope"), KeyFile: p("k")}, "nope"},
		{"key does not match", config.ServerTLSConfig{CertFile: p("c"), KeyFile: p("k2")}, "cert_file " + p("c") + " with key_file " + p("k2")},
		{"junk cert", config.ServerTLSConfig{CertFile: p("junk"), KeyFile: p("k")}, "cert_file " + p("junk")},
		{"junk client CA", config.ServerTLSConfig{CertFile: p("c"), KeyFile: p("k"), ClientCAFile: p("junk")}, "client_ca_file " + p("junk") + ": no PEM certificate"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewReloader(tc.cfg, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
			if !errors.Is(err, ErrTLS) && !errors.Is(err, config.ErrInvalidConfig) {
				t.Fatalf("err %v wraps neither ErrTLS nor ErrInvalidConfig", err)
			}
		})
	}
}
