//go:build unix

package kvstream

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// storeLockName is the lock file inside an embedded server's StoreDir.
const storeLockName = "kvrouter.lock"

// lockStore takes an exclusive advisory lock on dir (created if missing), so
// that two running servers never share one JetStream store: the second
// would read the first's snapshots as its own fleet. The lock goes with the
// process (flock), so a crash never leaves it behind; the file keeps the
// holder's pid for the error message.
func lockStore(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("kvstream: embedded nats store %s: %w", dir, err)
	}
	path := filepath.Join(dir, storeLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		return nil, fmt.Errorf("kvstream: embedded nats store %s: %w", dir, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b, _ := os.ReadFile(path)
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder := strings.TrimSpace(string(b))
			if _, perr := strconv.Atoi(holder); perr != nil {
				holder = "unknown"
			}
			return nil, fmt.Errorf("%w: %s is held by a running server (pid %s); give this one its own store_dir", ErrStoreInUse, dir, holder)
		}
		return nil, fmt.Errorf("kvstream: lock embedded nats store %s: %w", dir, err)
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return f, nil
}
