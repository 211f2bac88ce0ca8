//go:build unix

package testenv

import (
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

func TestMain(m *testing.M) {
	NATSProcessMain()
	os.Exit(m.Run())
}

// TestNATSProcess: the server runs in another process, takes JetStream
// publishes, and is gone once the test's cleanup has run.
func TestNATSProcess(t *testing.T) {
	var n *NATSProcess
	t.Run("serve", func(t *testing.T) {
		n = StartNATSProcess(t)
		if n.Pid == os.Getpid() {
			t.Fatal("the server runs in the test's own process")
		}
		nc, err := nats.Connect(n.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, _ := nc.JetStream()
		name := UniqueName(t)
		if _, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: nats.MemoryStorage}); err != nil {
			t.Fatal(err)
		}
		if ack, err := js.Publish(name+".a", []byte("x")); err != nil || ack.Sequence != 1 {
			t.Fatalf("publish: %+v %v", ack, err)
		}
	})
	// The subtest's cleanup stopped the server: its port refuses.
	if nc, err := nats.Connect(n.URL(), nats.Timeout(time.Second)); err == nil {
		nc.Close()
		t.Fatal("the server still answers after cleanup")
	}
	if err := syscall.Kill(n.Pid, 0); err != syscall.ESRCH {
		// Signal 0 finds no process once it has exited and been reaped.
		t.Fatalf("process %d still exists after cleanup", n.Pid)
	}
}
