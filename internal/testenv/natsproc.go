package testenv

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// natsProcEnv, in a test binary's environment, makes NATSProcessMain run
// a NATS server instead of the tests: "<port> <store dir>".
const natsProcEnv = "KVROUTER_TESTENV_NATS_PROCESS"

// NATSProcess is a NATS server with JetStream in its own OS process (the
// test binary run again), as production runs it: in its own pods, not on
// the router's cores. A benchmark can then tell its own CPU from the
// server's (cputime.Process, cputime.OfProcess(Pid)).
type NATSProcess struct {
	Port int
	Pid  int
}

// URL is the server's client URL.
func (n *NATSProcess) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// NATSProcessMain makes a test binary usable by StartNATSProcess: call it
// first in the package's TestMain. In the process StartNATSProcess starts
// it runs the server until its standard input closes (the test ended, or
// died) and exits; elsewhere it returns at once.
func NATSProcessMain() {
	arg := os.Getenv(natsProcEnv)
	if arg == "" {
		return
	}
	port, dir, _ := strings.Cut(arg, " ")
	p, err := strconv.Atoi(port)
	if err != nil {
		fmt.Fprintf(os.Stderr, "testenv: %s=%q: %v\n", natsProcEnv, arg, err)
		os.Exit(2)
	}
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: p, JetStream: true, StoreDir: dir, NoSigs: true, NoLog: true})
	if err != nil {
		fmt.Fprintf(os.Stderr, "testenv: nats server: %v\n", err)
		os.Exit(2)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		fmt.Fprintln(os.Stderr, "testenv: nats server not ready within 10s")
		os.Exit(2)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	s.Shutdown()
	s.WaitForShutdown()
	os.Exit(0)
}

// StartNATSProcess starts a NATS server with JetStream on a free port in a
// new process: this test binary, whose TestMain calls NATSProcessMain. It
// is stopped at cleanup.
func StartNATSProcess(t testing.TB) *NATSProcess {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("testenv: nats process: %v", err)
	}
	port := FreePort(t)
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d %s", natsProcEnv, port, t.TempDir()))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatalf("testenv: nats process: %v", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatalf("testenv: nats process: %v", err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("testenv: start nats process: %v", err)
	}
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		ready <- sc.Scan() && sc.Text() == "ready"
		for sc.Scan() {
		}
	}()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = stdin.Close()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("testenv: nats process did not start (does the package's TestMain call testenv.NATSProcessMain?)")
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("testenv: nats process not ready within 15s")
	}
	return &NATSProcess{Port: port, Pid: cmd.Process.Pid}
}
