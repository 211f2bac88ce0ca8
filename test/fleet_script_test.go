package test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// TestFleetScript runs the README's scripts/fleet.sh as a user would, with
// its first port taken by something else: the fleet comes up on the next
// free ports, a chat request through it is answered by kv_aware, and
// SIGINT stops every process it started.
func TestFleetScript(t *testing.T) {
	base := testenv.FreePorts(t, 16)
	busy, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	cmd := exec.CommandContext(ctx, filepath.Join("..", "scripts", "fleet.sh"), "-n", "2", "-p", fmt.Sprint(base), "-d", dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }()

	// Read the banner until the data-plane address appears.
	lines := make(chan string, 64)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	re := regexp.MustCompile(`data plane\s+(http://127\.0\.0\.1:(\d+))`)
	var url string
	for url == "" {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("fleet.sh ended before it was up: %s", stderr.String())
			}
			if m := re.FindStringSubmatch(l); m != nil {
				url = m[1]
			}
		case <-ctx.Done():
			t.Fatalf("fleet.sh not up: %s", stderr.String())
		}
	}
	if strings.HasSuffix(url, fmt.Sprintf(":%d", base)) {
		t.Fatalf("fleet took the busy port %d: %s", base, url)
	}
	body := `{"model":"meta-llama/Llama-3.1-70B-Instruct","messages":[{"role":"user","content":"hello"}],"max_tokens":4}`
	resp := testenv.Do(t, http.MethodPost, url+"/v1/chat/completions", []byte(body), nil)
	if resp.Status != 200 || resp.Header.Get("X-Kvrouter-Strategy") != "kv_aware" || resp.Header.Get("X-Kvrouter-Instance") == "" {
		t.Fatalf("request through the fleet: %d %v %s", resp.Status, resp.Header, resp.Body)
	}

	// Ctrl-C: the script stops its processes and exits; the router's port
	// is free again.
	if err := syscall.Kill(cmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("fleet.sh did not stop on SIGINT")
	}
	addr := strings.TrimPrefix(url, "http://")
	deadline := time.Now().Add(30 * time.Second)
	for {
		l, err := net.Listen("tcp", addr)
		if err == nil {
			l.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("router still listening on %s after the script stopped", addr)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
