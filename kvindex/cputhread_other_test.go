//go:build !linux

package kvindex

import "time"

// threadCPU is unknown on this platform: per-operation CPU metrics read -1.
func threadCPU() time.Duration { return -1 }
