//go:build !unix

package events

import "time"

// processCPU is unknown on this platform; CPU-time metrics read 0.
func processCPU() time.Duration { return 0 }
