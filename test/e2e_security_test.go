package test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
)

func writeSecFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestE2ESecurity runs the real binary with TLS (mTLS on), input limits
// and cache_salt, and talks to it as a real HTTPS client: the upstream
// receives the tenant's salt, limits answer OpenAI-shaped errors, clients
// without a trusted certificate are refused, and a certificate rotated on
// disk is served after SIGHUP.
func TestE2ESecurity(t *testing.T) {
	bin := buildRouter(t)
	dir := t.TempDir()
	serverCA, clientCA := testenv.NewCA(t, "server ca"), testenv.NewCA(t, "client ca")
	crt, key := serverCA.Issue(t, "leaf-11", 11, true)
	p := func(n string) string { return filepath.Join(dir, n) }
	writeSecFile(t, p("tls.crt"), crt)
	writeSecFile(t, p("tls.key"), key)
	writeSecFile(t, p("clients.pem"), clientCA.PEM)

	up := routertest.New(t, "vllm-0", routerModel)
	cfg := fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
log: {level: info, format: json}
tls: {cert_file: %s, key_file: %s, client_ca_file: %s, reload_interval: -1s}
limits: {max_messages: 2, max_header_bytes: 4096}
pools:
  - name: llama
    model: %s
    cache_salt: {enabled: true}
    health: {disable: true}
    discovery: {disable: true}
    instances: [{id: vllm-0, url: %q}]
`, p("tls.crt"), p("tls.key"), p("clients.pem"), routerModel, up.URL())
	writeSecFile(t, p("router.yaml"), []byte(cfg))
	secret := strings.Repeat("3c", 32)
	secretBytes, _ := hex.DecodeString(secret)
	proc := startRouter(t, bin, []string{config.CacheSaltSecretEnv + "=" + secret}, "--config", p("router.yaml"))
	base := strings.Replace(proc.data, "http://", "https://", 1)

	roots := x509.NewCertPool()
	roots.AddCert(serverCA.Cert)
	ccrt, ckey := clientCA.Issue(t, "leaf-21", 21, false)
	cpair, err := tls.X509KeyPair(ccrt, ckey)
	if err != nil {
		t.Fatal(err)
	}
	client := func(withCert bool) *http.Client {
		c := &tls.Config{RootCAs: roots}
		if withCert {
			c.Certificates = []tls.Certificate{cpair}
		}
		return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: c, DisableKeepAlives: true}}
	}
	post := func(cl *http.Client, body string, hdr map[string]string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := cl.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	chat := func(tenant string) map[string]string { return map[string]string{router.TenantHeader: tenant} }

	// Served over mTLS; the upstream gets the tenant's salt.
	salts := map[string]string{}
	for _, tenant := range []string{"acme", "acme", "globex"} {
		resp, body := post(client(true), chatJSON(routerModel, "hello", false), chat(tenant))
		if resp.StatusCode != http.StatusOK || resp.TLS == nil {
			t.Fatalf("tenant %s: status %d tls %v: %s", tenant, resp.StatusCode, resp.TLS != nil, body)
		}
		var fwd struct {
			CacheSalt string `json:"cache_salt"`
		}
		if err := json.Unmarshal(up.LastBody(), &fwd); err != nil {
			t.Fatal(err)
		}
		if want := router.DeriveCacheSalt(secretBytes, tenant); fwd.CacheSalt != want {
			t.Fatalf("tenant %s: upstream cache_salt %q, want %q", tenant, fwd.CacheSalt, want)
		}
		if prev, ok := salts[tenant]; ok && prev != fwd.CacheSalt {
			t.Fatalf("tenant %s: salt changed between requests", tenant)
		}
		salts[tenant] = fwd.CacheSalt
	}
	if salts["acme"] == salts["globex"] {
		t.Fatal("two tenants share a salt")
	}

	// Limits, OpenAI-shaped, over TLS.
	three := `{"model":"` + routerModel + `","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"},{"role":"user","content":"c"}]}`
	if resp, body := post(client(true), three, nil); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, `"message":"messages: 3 messages exceed the limit of 2"`) {
		t.Fatalf("max_messages: %d %s", resp.StatusCode, body)
	}
	if resp, body := post(client(true), chatJSON(routerModel, "x", false), map[string]string{"X-Pad": strings.Repeat("p", 5000)}); resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge || !strings.Contains(body, `"code":431`) {
		t.Fatalf("max_header_bytes: %d %s", resp.StatusCode, body)
	}

	// No client certificate: the handshake fails; plain HTTP is not served.
	if resp, err := client(false).Get(base + "/healthz"); err == nil {
		resp.Body.Close()
		t.Fatalf("served without a client certificate: %d", resp.StatusCode)
	}
	if resp, err := http.Get(proc.data + "/healthz"); err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatalf("plain HTTP served: %s", b)
		}
	}
	// The admin listener is TLS too.
	adminBase := strings.Replace(proc.admin, "http://", "https://", 1)
	if resp, err := client(true).Get(adminBase + "/healthz"); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("admin over TLS: %v", err)
	} else {
		resp.Body.Close()
	}

	// Rotate the certificate on disk; SIGHUP picks it up.
	crt2, key2 := serverCA.Issue(t, "leaf-12", 12, true)
	writeSecFile(t, p("tls.crt"), crt2)
	writeSecFile(t, p("tls.key"), key2)
	if err := proc.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := client(true).Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.TLS.PeerCertificates[0].SerialNumber.Int64() == 12 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("rotated certificate not served after SIGHUP\n%s", proc.logText())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(proc.logText(), "tls: certificate reloaded") {
		t.Errorf("no reload log line\n%s", proc.logText())
	}
}

// TestE2ESecurityStartupErrors: bad TLS files or a missing salt secret stop
// the binary before it listens, with an error naming the problem.
func TestE2ESecurityStartupErrors(t *testing.T) {
	bin := buildRouter(t)
	dir := t.TempDir()
	ca := testenv.NewCA(t, "ca")
	crt, _ := ca.Issue(t, "leaf-1", 1, true)
	_, otherKey := ca.Issue(t, "leaf-2", 2, true)
	writeSecFile(t, filepath.Join(dir, "tls.crt"), crt)
	writeSecFile(t, filepath.Join(dir, "other.key"), otherKey)
	pool := "pools:\n  - name: p\n    model: m\n    health: {disable: true}\n    discovery: {disable: true}\n    instances: [{id: a, url: 'http://127.0.0.1:1'}]\n"
	tests := []struct {
		name, yaml string
		env        []string
		want       string
	}{
		{"key file missing", fmt.Sprintf("listen: '127.0.0.1:0'\ntls: {cert_file: %s, key_file: %s}\n", filepath.Join(dir, "tls.crt"), filepath.Join(dir, "nope.key")) + pool, nil, "nope.key"},
		{"key does not match", fmt.Sprintf("listen: '127.0.0.1:0'\ntls: {cert_file: %s, key_file: %s}\n", filepath.Join(dir, "tls.crt"), filepath.Join(dir, "other.key")) + pool, nil, "private key does not match public key"},
		{"cache_salt without secret", "listen: '127.0.0.1:0'\n" + pool + "    cache_salt: {enabled: true}\n", nil, "KVROUTER_CACHE_SALT_SECRET"},
		{"secret not hex", "listen: '127.0.0.1:0'\n" + pool, []string{config.CacheSaltSecretEnv + "=xyz"}, "want hex"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfgPath := filepath.Join(t.TempDir(), "router.yaml")
			writeSecFile(t, cfgPath, []byte(tc.yaml))
			cmd := exec.Command(bin, "--config", cfgPath)
			cmd.Env = append(os.Environ(), tc.env...)
			done := make(chan struct{})
			var out []byte
			var err error
			go func() { out, err = cmd.CombinedOutput(); close(done) }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				_ = cmd.Process.Kill()
				t.Fatal("kvrouter kept running")
			}
			if err == nil || !strings.Contains(string(out), tc.want) {
				t.Fatalf("exit %v, output %q; want a failure mentioning %q", err, out, tc.want)
			}
		})
	}
}
