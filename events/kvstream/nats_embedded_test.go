package kvstream

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestEmbeddedNATSPortInUse: a taken port fails at once with
// ErrPortInUse, not after ReadyTimeout of silence.
func TestEmbeddedNATSPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	start := time.Now()
	_, err = StartEmbeddedNATS(context.Background(), EmbeddedNATSConfig{Port: port, StoreDir: t.TempDir(), ReadyTimeout: time.Minute})
	if !errors.Is(err, ErrPortInUse) || !strings.Contains(err.Error(), "127.0.0.1:"+strconv.Itoa(port)) {
		t.Fatalf("err %v, want ErrPortInUse naming the address", err)
	}
	// A minute of ReadyTimeout was not waited for (the probe is one bind).
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("failing took %v", d)
	}
}

// TestEmbeddedNATSStoreLock: one running server owns a store; a second on
// the same folder is refused with the holder's pid; after Shutdown the store
// is free again. A free-port server with no store gets its own temporary
// folder, removed at Shutdown.
func TestEmbeddedNATSStoreLock(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	a, err := StartEmbeddedNATS(ctx, EmbeddedNATSConfig{Port: -1, StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	_, err = StartEmbeddedNATS(ctx, EmbeddedNATSConfig{Port: -1, StoreDir: dir})
	if !errors.Is(err, ErrStoreInUse) || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("second server on one store: %v, want ErrStoreInUse with the holder's pid", err)
	}
	a.Shutdown()
	b, err := StartEmbeddedNATS(ctx, EmbeddedNATSConfig{Port: -1, StoreDir: dir})
	if err != nil {
		t.Fatalf("store not released by Shutdown: %v", err)
	}
	b.Shutdown()

	c, err := StartEmbeddedNATS(ctx, EmbeddedNATSConfig{Port: -1})
	if err != nil {
		t.Fatal(err)
	}
	own := c.StoreDir()
	if own == "" || filepath.Dir(own) != filepath.Clean(os.TempDir()) {
		t.Fatalf("free-port store %q, want a folder in %s", own, os.TempDir())
	}
	if _, err := os.Stat(own); err != nil {
		t.Fatal(err)
	}
	c.Shutdown()
	if _, err := os.Stat(own); !os.IsNotExist(err) {
		t.Fatalf("temporary store %s left behind: %v", own, err)
	}
}
