package kvstream

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
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
	// StoreDir holds JetStream files, so snapshots and the stream survive a
	// router restart (default $TMPDIR/kvrouter-nats-<port>; with Port -1, a
	// new temporary folder removed at Shutdown). One running
	// server owns a store: a second one started on the same folder is
	// refused (ErrStoreInUse) instead of reading another fleet's state.
	StoreDir string
	// ReadyTimeout defaults to 10s.
	ReadyTimeout time.Duration
}

// ErrPortInUse is returned when the embedded server's port is taken.
var ErrPortInUse = errors.New("kvstream: embedded nats port in use")

// ErrStoreInUse is returned when another running server holds StoreDir.
var ErrStoreInUse = errors.New("kvstream: embedded nats store in use")

// EmbeddedNATS is an in-process NATS server with JetStream.
type EmbeddedNATS struct {
	srv      *server.Server
	storeDir string
	lock     *os.File // the StoreDir lock, held while the server runs
	remove   bool     // StoreDir is this server's own temporary folder
	done     chan struct{}
	once     sync.Once // guards closing done
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
	if cfg.Port < -1 || cfg.Port > 65535 {
		return nil, fmt.Errorf("kvstream: embedded nats port %d out of range", cfg.Port)
	}
	removeStore := false
	switch {
	case cfg.StoreDir != "":
	case cfg.Port > 0:
		cfg.StoreDir = filepath.Join(os.TempDir(), fmt.Sprintf("kvrouter-nats-%d", cfg.Port))
	default: // a free port: nothing to find again after a restart
		dir, err := os.MkdirTemp("", "kvrouter-nats-")
		if err != nil {
			return nil, fmt.Errorf("kvstream: embedded nats store: %w", err)
		}
		cfg.StoreDir, removeStore = dir, true
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 10 * time.Second
	}
	// A taken port would otherwise surface only as ReadyTimeout seconds of
	// silence: probe it first and fail at once.
	if cfg.Port > 0 {
		addr := net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port))
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrPortInUse, addr, err)
		}
		_ = ln.Close()
	}
	lock, err := lockStore(cfg.StoreDir)
	if err != nil {
		return nil, err
	}
	release := func() {
		_ = lock.Close()
		if removeStore {
			_ = os.RemoveAll(cfg.StoreDir)
		}
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
		release()
		return nil, fmt.Errorf("kvstream: embedded nats: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(cfg.ReadyTimeout) {
		srv.Shutdown()
		release()
		return nil, fmt.Errorf("kvstream: embedded nats did not become ready in %v", cfg.ReadyTimeout)
	}
	e := &EmbeddedNATS{srv: srv, storeDir: cfg.StoreDir, lock: lock, remove: removeStore, done: make(chan struct{})}
	go func() {
		select {
		case <-ctx.Done():
			e.Shutdown()
		case <-e.done:
		}
	}()
	return e, nil
}

// StoreDir is the folder holding the server's JetStream files.
func (e *EmbeddedNATS) StoreDir() string { return e.storeDir }

// ClientURL is the URL clients (and bridges on this host) connect to.
func (e *EmbeddedNATS) ClientURL() string { return e.srv.ClientURL() }

// Shutdown stops the server and waits for it.
func (e *EmbeddedNATS) Shutdown() {
	e.once.Do(func() {
		close(e.done)
		e.srv.Shutdown()
		e.srv.WaitForShutdown()
		_ = e.lock.Close() // releases the store
		if e.remove {
			_ = os.RemoveAll(e.storeDir)
		}
	})
	e.srv.WaitForShutdown()
}
