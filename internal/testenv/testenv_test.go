package testenv

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
)

func TestRedisAnswersPing(t *testing.T) {
	addr := Redis(t)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	n, err := c.Read(buf)
	if err != nil || string(buf[:n]) != "+PONG\r\n" {
		t.Fatalf("PING: got %q, %v", buf[:n], err)
	}
}

func TestNATSRestartKeepsJetStream(t *testing.T) {
	s := StartNATS(t)
	nc, err := nats.Connect(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	js, _ := nc.JetStream()
	name := UniqueName(t)
	if _, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name + ".>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(name+".a", []byte("x")); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	s = s.Restart(t)
	nc, err = nats.Connect(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ = nc.JetStream()
	info, err := js.StreamInfo(name)
	if err != nil || info.State.Msgs != 1 {
		t.Fatalf("after restart: %+v %v", info, err)
	}
}

func TestRedisClusterFailover(t *testing.T) {
	c := StartRedisCluster(t)
	ctx := context.Background()
	cl := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer cl.Close()
	// Keys over every master (no hash tags): the client routes each.
	for i := range 100 {
		if err := cl.Set(ctx, fmt.Sprintf("k%d", i), i, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	masters := c.Masters()
	if len(masters) != 3 {
		t.Fatalf("%d masters", len(masters))
	}
	if err := cl.Do(ctx, "mset", "a", 1, "b", 2).Err(); err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
		t.Fatalf("MSET across slots = %v, want CROSSSLOT", err)
	}
	// A master dies: its replica takes over; restarted, it rejoins as a
	// replica and the cluster is whole again.
	masters[0].Kill()
	deadline := time.Now().Add(30 * time.Second)
	for len(c.Masters()) != 3 {
		if time.Now().After(deadline) {
			t.Fatal("no replica promoted within 30s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	masters[0].Start()
	c.WaitHealthy(30 * time.Second)
	if r := c.Role(masters[0]); r != "slave" {
		t.Fatalf("restarted master is %q, want slave", r)
	}
}

// TestFreePortNeverTwice: ports handed out and not yet bound are free
// again, yet no call returns a port an earlier one did (nor one inside a
// FreePorts range).
func TestFreePortNeverTwice(t *testing.T) {
	seen := map[int]bool{}
	base := FreePorts(t, 4)
	for j := range 4 {
		seen[base+j] = true
	}
	for range 2000 {
		p := FreePort(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
	}
}

// stop cancels run's context and returns only once run has returned; a
// second stop (the cleanup's) returns at once.
func TestGoStopWaitsForRun(t *testing.T) {
	started, returned := make(chan struct{}), false
	stop := Go(t, context.Background(), func(ctx context.Context) error {
		close(started)
		<-ctx.Done()
		time.Sleep(20 * time.Millisecond)
		returned = true
		return ctx.Err()
	})
	<-started
	stop()
	if !returned {
		t.Fatal("stop returned before run did")
	}
	stop()
}

func TestWaitForPollsUntilTrue(t *testing.T) {
	n := 0
	WaitFor(t, 5*time.Second, "the third poll", func() bool { n++; return n == 3 })
	if n != 3 {
		t.Fatalf("cond polled %d times, want 3", n)
	}
}

// A certificate the CA issues verifies against the CA, for the use it was
// issued for.
func TestCAIssueVerifies(t *testing.T) {
	ca := NewCA(t, "ca")
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	for _, server := range []bool{true, false} {
		certPEM, keyPEM := ca.Issue(t, "leaf", 2, server)
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		use, name := x509.ExtKeyUsageClientAuth, ""
		if server {
			use, name = x509.ExtKeyUsageServerAuth, "127.0.0.1"
		}
		if _, err := pair.Leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: name, KeyUsages: []x509.ExtKeyUsage{use}}); err != nil {
			t.Errorf("server=%v: %v", server, err)
		}
	}
}

// SelfSigned's files make a key pair its pool trusts, for 127.0.0.1, as a
// server and as a client.
func TestSelfSignedTrusted(t *testing.T) {
	certFile, keyFile, roots := SelfSigned(t, t.TempDir())
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, use := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := pair.Leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: "127.0.0.1", KeyUsages: []x509.ExtKeyUsage{use}}); err != nil {
			t.Errorf("usage %v: %v", use, err)
		}
	}
}

// fatalRecorder is a testing.TB whose Fatalf records instead of stopping.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper()                           {}
func (f *fatalRecorder) Fatalf(format string, args ...any) { f.msg = fmt.Sprintf(format, args...) }

func TestValue(t *testing.T) {
	const name = "KVROUTER_TESTENV_VALUE"
	t.Setenv(name, "")
	if v := Value(t, name, 2.5); v != 2.5 {
		t.Errorf("unset: %v, want the default 2.5", v)
	}
	t.Setenv(name, "7.25")
	if v := Value(t, name, 2.5); v != 7.25 {
		t.Errorf("7.25: %v", v)
	}
	t.Setenv(name, "18446744073709551615")
	if v := Value(t, name, uint64(1)); v != 1<<64-1 {
		t.Errorf("max uint64: %v", v)
	}
	t.Setenv(name, "many")
	f := &fatalRecorder{TB: t}
	Value(f, name, 3)
	if !strings.Contains(f.msg, name) {
		t.Errorf("a value that is not a number: fatal %q, want one naming %s", f.msg, name)
	}
}
