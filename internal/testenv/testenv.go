// Package testenv starts the real services tests need: a redis-server on a
// free port (unless REDIS_ADDR names one) and an embedded NATS server with
// JetStream (unless NATS_URL names one). Tests that share a server must use
// their own key prefix, subjects and stream names; see UniqueName.
package testenv

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

var seq atomic.Uint64

// UniqueName returns a name unique to this test process and call, safe for
// Redis key prefixes, NATS subject tokens and stream names.
func UniqueName(t testing.TB) string {
	n := strings.NewReplacer("/", "_", " ", "_", ".", "_", "*", "_", ">", "_").Replace(t.Name())
	if len(n) > 40 {
		n = n[:40]
	}
	return fmt.Sprintf("t%d_%d_%s", os.Getpid(), seq.Add(1), n)
}

// handedOut is every port FreePort and FreePorts returned in this process:
// a port returned but not yet bound is free again, so without this a
// harness that asks for several ports before starting anything could get
// the same one twice (seen: a kvsim given one port for HTTP and ZMQ).
var handedOut struct {
	sync.Mutex
	ports map[int]bool
}

// claim reserves ports p .. p+n-1 for the caller unless one was handed out
// before.
func claim(p, n int) bool {
	handedOut.Lock()
	defer handedOut.Unlock()
	for j := range n {
		if handedOut.ports[p+j] {
			return false
		}
	}
	if handedOut.ports == nil {
		handedOut.ports = map[int]bool{}
	}
	for j := range n {
		handedOut.ports[p+j] = true
	}
	return true
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago and
// that no earlier call in this process returned.
//
// It draws from 20000..32767, below Linux's ephemeral range (32768..60999):
// a port the kernel hands out itself can be taken again at once by any
// outgoing connection of a test running in parallel, while a random port
// outside that range is only ever taken by another explicit bind.
func FreePort(t testing.TB) int {
	t.Helper()
	for i := 0; i < 200; i++ {
		port := 20000 + rand.IntN(32768-20000)
		if !claim(port, 1) {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		l.Close()
		return port
	}
	t.Fatalf("testenv: no free port in 20000..32767 after 200 tries")
	return 0
}

// FreePorts returns p such that p .. p+n-1 were all free a moment ago
// (for engines that use port+rank), from the same range as FreePort.
func FreePorts(t testing.TB, n int) int {
	t.Helper()
	for i := 0; i < 200; i++ {
		p := 20000 + rand.IntN(32768-20000-n)
		if !claim(p, n) {
			continue
		}
		var ls []net.Listener
		for j := 0; j < n; j++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+j))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if len(ls) == n {
			return p
		}
	}
	t.Fatalf("testenv: no %d consecutive free ports in 20000..32767 after 200 tries", n)
	return 0
}

// Redis returns the address of a Redis server for the test: REDIS_ADDR when
// set, else a redis-server started on a free port and stopped at cleanup.
// It fails the test with a clear message when neither is possible.
func Redis(t testing.TB) string {
	t.Helper()
	if a := os.Getenv("REDIS_ADDR"); a != "" {
		return a
	}
	return StartRedis(t).Addr
}

// RedisServer is a redis-server process of one test, without persistence,
// that the test can kill and start again on the same port: it comes back
// empty, as a Redis without persistence does after a crash.
type RedisServer struct {
	Addr string
	t    testing.TB
	bin  string
	port int
	dir  string
	args []string   // more redis-server arguments (cluster nodes)
	mu   sync.Mutex // guards cmd
	cmd  *exec.Cmd
}

// StartRedis starts a redis-server on a free port (REDIS_ADDR is not used:
// the test needs a process it owns); it is killed at cleanup.
func StartRedis(t testing.TB) *RedisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("testenv: no redis-server on PATH (run `make deps-test`): %v", err)
	}
	port := FreePort(t)
	s := &RedisServer{Addr: fmt.Sprintf("127.0.0.1:%d", port), t: t, bin: bin, port: port, dir: t.TempDir()}
	s.Start()
	t.Cleanup(s.Kill)
	return s
}

// Start starts the server (again) and waits until it accepts connections.
func (s *RedisServer) Start() {
	s.t.Helper()
	args := append([]string{"--port", fmt.Sprint(s.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", s.dir, "--loglevel", "warning"}, s.args...)
	cmd := exec.Command(s.bin, args...)
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("testenv: start redis-server: %v", err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
		}
	}()
	s.mu.Lock()
	s.cmd = cmd
	s.mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		c, err := net.DialTimeout("tcp", s.Addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.t.Fatalf("testenv: redis-server on %s did not start within 10s", s.Addr)
}

// Kill kills the server (SIGKILL) and waits for it to exit; its data is
// gone. Killing a stopped server does nothing.
func (s *RedisServer) Kill() {
	s.mu.Lock()
	cmd := s.cmd
	s.cmd = nil
	s.mu.Unlock()
	if cmd != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
}

// Pause stops the server's process (SIGSTOP): it holds its connections
// and answers nothing, as a Redis stuck on a slow disk, a fork or a VM
// pause does, until Resume. Kill also ends a paused server.
func (s *RedisServer) Pause() { s.signal(syscall.SIGSTOP) }

// Resume lets a paused server run again (SIGCONT): it then executes what
// its clients sent meanwhile.
func (s *RedisServer) Resume() { s.signal(syscall.SIGCONT) }

func (s *RedisServer) signal(sig syscall.Signal) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("testenv: redis-server on %s is not running", s.Addr)
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("testenv: signal redis-server: %v", err)
	}
}

// NATSServer is an embedded NATS server with JetStream for one test.
type NATSServer struct {
	*server.Server
	StoreDir string
	Port     int
}

// StartNATS starts an embedded NATS server with JetStream on a free port;
// it is shut down at cleanup. Pass the same storeDir and port to Restart it.
func StartNATS(t testing.TB) *NATSServer {
	t.Helper()
	return startNATS(t, t.TempDir(), -1)
}

// StartNATSWith is StartNATS with the server's options changed by set
// first (a lower max payload, say).
func StartNATSWith(t testing.TB, set func(*server.Options)) *NATSServer {
	t.Helper()
	return startNATS(t, t.TempDir(), -1, set)
}

func startNATS(t testing.TB, dir string, port int, set ...func(*server.Options)) *NATSServer {
	t.Helper()
	if port < 0 {
		port = FreePort(t)
	}
	opts := &server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoSigs: true, NoLog: true}
	for _, f := range set {
		f(opts)
	}
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("testenv: nats server: %v", err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatalf("testenv: nats server not ready within 10s")
	}
	ns := &NATSServer{Server: s, StoreDir: dir, Port: port}
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	return ns
}

// URL is the client URL of the server.
func (n *NATSServer) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Restart shuts the server down and starts a new one on the same port and
// store directory (JetStream state survives), as an operator restart would.
func (n *NATSServer) Restart(t testing.TB) *NATSServer {
	t.Helper()
	n.Shutdown()
	n.WaitForShutdown()
	return startNATS(t, n.StoreDir, n.Port)
}

// NATSURL returns NATS_URL when set, else starts an embedded server.
func NATSURL(t testing.TB) string {
	t.Helper()
	if u := os.Getenv("NATS_URL"); u != "" {
		return u
	}
	return StartNATS(t).URL()
}

// Context returns a context cancelled at test cleanup, with a deadline.
func Context(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// Value is the environment variable name read as a T (fmt.Sscan: numbers,
// durations in seconds as floats, words), def when it is unset or empty. A
// value that does not read as a T fails the test: a mistyped knob should
// not run the default silently.
func Value[T any](t testing.TB, name string, def T) T {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	var v T
	if _, err := fmt.Sscan(s, &v); err != nil {
		t.Fatalf("%s=%q: %v", name, s, err)
	}
	return v
}
