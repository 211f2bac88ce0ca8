package test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFreshClone clones the repository's committed state into an empty
// folder, with nothing beside it, and runs there what a new user runs:
// vet and the unit tests of every package (-short; the end-to-end
// packages under test/ run from this tree in make test), and a 10 s
// kvbench demo. A
// file the tree needs but does not hold — a trace, a tokenizer, a fixture,
// a path of one machine — fails here rather than on a user's machine.
//
// The clone takes what is committed: run it after committing.
func TestFreshClone(t *testing.T) {
	if testing.Short() {
		// The clone's own -short run reaches this test: no clone of a clone.
		t.Log("-short: no fresh clone")
		return
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, ".git")); err != nil {
		t.Fatalf("the repository's .git is needed to clone it: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	// A folder of its own: nothing beside the clone.
	dir := filepath.Join(t.TempDir(), "empty")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	clone := filepath.Join(dir, "kvrouter")
	run := func(name string, d time.Duration, args ...string) string {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		cmd := exec.CommandContext(cctx, args[0], args[1:]...)
		cmd.Dir = clone
		// The clone's own TMPDIR: nothing shared with this tree's runs.
		tmp := filepath.Join(dir, "tmp")
		_ = os.MkdirAll(tmp, 0o755)
		cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s in the fresh clone: %v\nfailures:\n%s\nlast lines:\n%s", name, err, failures(string(out), 60), tail(string(out), 30))
		}
		return string(out)
	}
	cmd := exec.CommandContext(ctx, "git", "clone", "--quiet", "--no-hardlinks", root, clone)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git clone: %v\n%s", err, out)
	}
	run("go vet", 10*time.Minute, "go", "vet", "./...")
	// Every package's unit tests; the end-to-end packages under test/
	// already run from this tree in the same make test (running them twice
	// would double their time for no file they could find missing here:
	// they read nothing the unit tests do not).
	list := run("go list", 5*time.Minute, "go", "list", "./...")
	var pkgs []string
	for _, p := range strings.Fields(list) {
		if p != "github.com/kvrouter/kvrouter/test" && !strings.HasPrefix(p, "github.com/kvrouter/kvrouter/test/") {
			pkgs = append(pkgs, p)
		}
	}
	out := run("go test -short", 20*time.Minute, append([]string{"go", "test", "-count=1", "-short"}, pkgs...)...)
	if !strings.Contains(out, "ok  \tgithub.com/kvrouter/kvrouter/router") || !strings.Contains(out, "ok  \tgithub.com/kvrouter/kvrouter/workload") {
		t.Fatalf("the router's and workload's tests did not run in the clone:\n%s", tail(out, 40))
	}
	demo := run("kvbench demo", 5*time.Minute, "go", "run", "./cmd/kvbench", "demo", "--duration", "5s", "--out", filepath.Join(dir, "demo"))
	for _, want := range []string{"prefix_aware", "kv_aware"} {
		if !strings.Contains(demo, want) {
			t.Errorf("demo output lacks %q:\n%s", want, tail(demo, 40))
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "demo")); err != nil {
		t.Errorf("the demo wrote no report: %v", err)
	}
}

// failures is up to n lines of s that say what failed: go test's FAIL
// lines, test log lines (file_test.go:N:) and panics; a package's debug
// logs would otherwise push them out of the tail.
func failures(s string, n int) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "--- FAIL") || strings.HasPrefix(t, "FAIL") || strings.HasPrefix(t, "panic:") ||
			strings.Contains(t, "_test.go:") {
			out = append(out, l)
		}
		if len(out) == n {
			break
		}
	}
	return strings.Join(out, "\n")
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
