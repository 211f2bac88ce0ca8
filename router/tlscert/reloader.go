// Package tlscert serves a listener's certificate from files that rotate:
// the data and admin HTTP listeners and the gRPC listener share one
// Reloader, which re-reads the files when they change and keeps the loaded
// pair when a rotation is half-written.
package tlscert

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/config"
)

// ErrTLS reports TLS files that cannot be used.
var ErrTLS = errors.New("router: tls")

// Reloader serves the current certificate (and client CAs) of a
// ServerTLSConfig to TLS handshakes, and re-reads the files on Reload and,
// from Run, when their content changes. A reload that fails (a half-written
// rotation: new certificate, old key) keeps the loaded pair and is retried.
type Reloader struct {
	cfg config.ServerTLSConfig
	min uint16
	log *slog.Logger

	// mu guards files: the bytes of the files currently loaded, which Reload
	// compares to decide whether anything changed.
	mu    sync.Mutex
	files [3][]byte

	// cur is the per-handshake config built from the loaded files.
	cur atomic.Pointer[tls.Config]
}

// NewReloader loads the files of c (validated) and fails with an error
// naming the file when one is missing, unreadable or not a matching pair.
func NewReloader(c config.ServerTLSConfig, log *slog.Logger) (*Reloader, error) {
	if err := c.Validate("tls"); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	minV, _ := config.TLSMinVersion(c.MinVersion)
	r := &Reloader{cfg: c, min: minV, log: log}
	if _, err := r.Reload(); err != nil {
		return nil, err
	}
	return r, nil
}

// Reload re-reads the files; changed is false when their content is the
// same as what is loaded. On error the loaded certificate stays in use.
func (r *Reloader) Reload() (changed bool, err error) {
	paths := [3]string{r.cfg.CertFile, r.cfg.KeyFile, r.cfg.ClientCAFile}
	var files [3][]byte
	for i, p := range paths {
		if p == "" {
			continue
		}
		if files[i], err = os.ReadFile(p); err != nil {
			return false, fmt.Errorf("%w: %w", ErrTLS, err)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cur.Load() != nil && bytes.Equal(files[0], r.files[0]) && bytes.Equal(files[1], r.files[1]) && bytes.Equal(files[2], r.files[2]) {
		return false, nil
	}
	cert, err := tls.X509KeyPair(files[0], files[1])
	if err != nil {
		return false, fmt.Errorf("%w: cert_file %s with key_file %s: %w", ErrTLS, paths[0], paths[1], err)
	}
	cfg := &tls.Config{
		MinVersion:   r.min,
		Certificates: []tls.Certificate{cert},
		// HTTP/1.1 only: instances speak HTTP/1.1 and SSE streams need no
		// multiplexing; one protocol keeps deadlines and limits uniform.
		NextProtos: []string{"http/1.1"},
	}
	if paths[2] != "" {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(files[2]) {
			return false, fmt.Errorf("%w: client_ca_file %s: no PEM certificate in it", ErrTLS, paths[2])
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	r.files = files
	r.cur.Store(cfg)
	return true, nil
}

// TLSConfig is the config to serve with (tls.NewListener or
// http.Server.TLSConfig): every handshake uses the latest loaded files.
func (r *Reloader) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion: r.min,
		NextProtos: []string{"http/1.1"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return r.cur.Load(), nil
		},
	}
}

// Run re-reads the files every reload_interval until ctx ends (nothing
// when the interval is negative), logging changes and failures.
func (r *Reloader) Run(ctx context.Context) {
	iv := r.cfg.ReloadInterval
	if iv < 0 {
		return
	}
	if iv == 0 {
		iv = config.DefaultTLSReloadInterval
	}
	t := time.NewTicker(iv)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.reloadAndLog("file change")
		}
	}
}

// ReloadAndLog is Reload for a SIGHUP: the outcome is logged, not returned.
func (r *Reloader) ReloadAndLog() { r.reloadAndLog("reload") }

func (r *Reloader) reloadAndLog(why string) {
	changed, err := r.Reload()
	switch {
	case err != nil:
		r.log.Error("tls: reloading certificate failed; keeping the loaded one", "cause", why, "err", err)
	case changed:
		r.log.Info("tls: certificate reloaded", "cause", why, "cert_file", r.cfg.CertFile)
	}
}
