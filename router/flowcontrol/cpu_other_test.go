//go:build !unix

package flowcontrol

import "time"

func processCPU() time.Duration { return -1 }
