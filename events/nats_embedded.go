package events

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// EmbeddedNATSConfig configures StartEmbeddedNATS. Zero values mean defaults.
type EmbeddedNATSConfig struct {
	// Host defaults to 127.0.0.1: a single-machine setup should not be
	// reachable from elsewhere unless asked (set 0.0.0.0 so bridges on
	// other hosts can connect).
	Host string
	// Port defaults to 4222, NATS's standard port, so bridges use the
	// usual nats://<router-host>:4222. -1 picks a free port.
	Port int
	// StoreDir holds JetStream files (default $TMPDIR/kvrouter-nats), so
	// snapshots and the stream survive a router restart.
	StoreDir string
	// ReadyTimeout defaults to 10s.
	ReadyTimeout time.Duration
}

// EmbeddedNATS is an in-process NATS server with JetStream.
type EmbeddedNATS struct {
	srv  *server.Server
	done chan struct{}
	once sync.Once // guards closing done
}

// StartEmbeddedNATS starts a NATS server with JetStream inside this
// process. It shuts down when ctx is done or Shutdown is called.
func StartEmbeddedNATS(ctx context.Context, cfg EmbeddedNATSConfig) (*EmbeddedNATS, error) {
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.Port == 0 {
		cfg.Port = 4222
	}
	if cfg.StoreDir == "" {
		cfg.StoreDir = filepath.Join(os.TempDir(), "kvrouter-nats")
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 10 * time.Second
	}
	if cfg.Port < -1 || cfg.Port > 65535 {
		return nil, fmt.Errorf("events: embedded nats port %d out of range", cfg.Port)
	}
	opts := &server.Options{
		ServerName: "kvrouter-embedded",
		Host:       cfg.Host,
		Port:       cfg.Port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		NoSigs:     true,
		NoLog:      true,
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("events: embedded nats: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(cfg.ReadyTimeout) {
		srv.Shutdown()
		return nil, errors.New("events: embedded nats did not become ready (port in use?)")
	}
	e := &EmbeddedNATS{srv: srv, done: make(chan struct{})}
	go func() {
		select {
		case <-ctx.Done():
			srv.Shutdown()
		case <-e.done:
		}
	}()
	return e, nil
}

// ClientURL is the URL clients (and bridges on this host) connect to.
func (e *EmbeddedNATS) ClientURL() string { return e.srv.ClientURL() }

// Shutdown stops the server and waits for it.
func (e *EmbeddedNATS) Shutdown() {
	e.once.Do(func() { close(e.done) })
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
}
