package cputime

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

// TestOfProcess: this process's clock read by pid agrees with getrusage,
// and another process's CPU (a shell busy-looping) is read while it runs
// and is at most what the kernel reports for it once it has exited.
func TestOfProcess(t *testing.T) {
	x := 0
	for c0 := Process(); Process()-c0 < 20*time.Millisecond; x++ {
	}
	before, self, after := Process(), OfProcess(os.Getpid()), Process()
	// getrusage rounds to the scheduler's accounting; the clock does not.
	if self < before-10*time.Millisecond || self > after+10*time.Millisecond {
		t.Fatalf("OfProcess(self) %v, getrusage %v..%v", self, before, after)
	}
	cmd := exec.Command("sh", "-c", "while :; do :; done")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var seen time.Duration
	deadline := time.Now().Add(10 * time.Second)
	for seen < 50*time.Millisecond && time.Now().Before(deadline) {
		seen = OfProcess(cmd.Process.Pid)
		if seen < 0 {
			t.Fatalf("OfProcess(child) = %v", seen)
		}
		time.Sleep(5 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if seen < 50*time.Millisecond {
		t.Fatalf("a busy child used %v of CPU in 10s by OfProcess", seen)
	}
	u := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	if seen > u+10*time.Millisecond {
		t.Fatalf("OfProcess read %v while running, the kernel's total at exit is %v", seen, u)
	}
	if got := OfProcess(cmd.Process.Pid); got >= 0 {
		t.Fatalf("OfProcess of a reaped process = %v, want -1", got)
	}
}
