//go:build !unix

package kvstream

import (
	"fmt"
	"os"
)

// lockStore creates dir; without flock (non-Unix) a shared store is not
// detected, so give each server its own store_dir there.
func lockStore(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("kvstream: embedded nats store %s: %w", dir, err)
	}
	return os.Open(dir)
}
