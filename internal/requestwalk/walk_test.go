package main

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// maxWalkFiles is issue 10's bound on the request walk: the files of the
// module one plain chat completion runs code in (docs/architecture.md,
// "The request walk").
const maxWalkFiles = 12

// TestRequestWalk builds this command with coverage, serves one request
// through it and counts the module's files whose code that request ran,
// so that the walk cannot grow past its bound unnoticed.
func TestRequestWalk(t *testing.T) {
	if testing.Short() {
		t.Log("-short: the coverage build is not made")
		return
	}
	dir := t.TempDir()
	bin, data, text := filepath.Join(dir, "requestwalk"), filepath.Join(dir, "cov"), filepath.Join(dir, "cov.txt")
	run := func(name string, args ...string) {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Env = append(os.Environ(), "GOCOVERDIR="+data)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
	}
	if err := os.Mkdir(data, 0o700); err != nil {
		t.Fatal(err)
	}
	run("go", "build", "-cover", "-covermode=atomic", "-coverpkg=github.com/kvrouter/kvrouter/...", "-o", bin, ".")
	run(bin, data)
	run("go", "tool", "covdata", "textfmt", "-i="+data, "-o="+text)

	f, err := os.Open(text)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var files []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// mode: atomic, then "path/file.go:l.c,l.c statements count".
		line := sc.Text()
		file, _, ok := strings.Cut(line, ":")
		fields := strings.Fields(line)
		if !ok || len(fields) != 3 || fields[2] == "0" || strings.Contains(file, "/internal/requestwalk/") {
			continue
		}
		if !slices.Contains(files, file) {
			files = append(files, file)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(files)
	t.Logf("%d files: %s", len(files), strings.Join(files, " "))
	if len(files) == 0 || len(files) > maxWalkFiles {
		t.Errorf("one chat completion ran code in %d files of the module, want 1..%d", len(files), maxWalkFiles)
	}
}
