//go:build !linux

package des

import "time"

// threadCPU: no per-thread CPU clock on this platform (decision CPU time
// is then not reported).
func threadCPU() time.Duration { return -1 }
