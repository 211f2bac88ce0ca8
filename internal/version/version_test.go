package version

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

func TestResolve(t *testing.T) {
	info := func(mainVersion string, settings ...string) *debug.BuildInfo {
		bi := &debug.BuildInfo{GoVersion: "go1.99", Main: debug.Module{Path: "github.com/kvrouter/kvrouter", Version: mainVersion}}
		for i := 0; i+1 < len(settings); i += 2 {
			bi.Settings = append(bi.Settings, debug.BuildSetting{Key: settings[i], Value: settings[i+1]})
		}
		return bi
	}
	for _, tc := range []struct {
		name                string
		bi                  *debug.BuildInfo
		ldVersion, ldCommit string
		want                Info
	}{
		{"linker wins", info("v0.0.9", "vcs.revision", "aaaa"), "v0.1.0", "bbbb", Info{"v0.1.0", "bbbb", "go1.99"}},
		{"go install of a release", info("v0.2.0"), "", "", Info{"v0.2.0", "unknown", "go1.99"}},
		{"build in the tree", info("(devel)", "vcs.revision", "cafe", "vcs.modified", "false"), "", "", Info{"dev", "cafe", "go1.99"}},
		{"uncommitted changes", info("(devel)", "vcs.revision", "cafe", "vcs.modified", "true"), "", "", Info{"dev", "cafe-dirty", "go1.99"}},
		{"-buildvcs=false", info("(devel)"), "", "", Info{"dev", "unknown", "go1.99"}},
		{"no build info", nil, "", "", Info{"dev", "unknown", ""}},
		{"commit injected alone", info("(devel)", "vcs.revision", "cafe"), "", "beef", Info{"dev", "beef", "go1.99"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := resolve(tc.bi, tc.ldVersion, tc.ldCommit); got != tc.want {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestString(t *testing.T) {
	if got, want := (Info{"v0.1.0", "abc", "go1.26.8"}).String("kvrouter"), "kvrouter v0.1.0 (commit abc, go1.26.8)"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if got, want := (Info{"dev", "unknown", ""}).String("kvctl"), "kvctl dev (commit unknown)"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestRequested(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want bool
	}{
		{[]string{"--version"}, true},
		{[]string{"-version"}, true},
		{[]string{"--version", "--config=x"}, true},
		{nil, false},
		{[]string{"version"}, false},
		{[]string{"--config=x", "--version"}, false}, // a subcommand's or flag's business
		{[]string{"--versions"}, false},
	} {
		if got := Requested(tc.args); got != tc.want {
			t.Errorf("Requested(%q) = %v, want %v", tc.args, got, tc.want)
		}
	}
}

// TestGetInTestBinary: without linker values, a binary built inside the
// module reports "dev" and the toolchain that built it.
func TestGetInTestBinary(t *testing.T) {
	got := Get()
	if got.Version != "dev" || got.GoVersion != runtime.Version() || got.Commit == "" {
		t.Errorf("Get() = %+v, want version dev and Go %s", got, runtime.Version())
	}
}

// TestBinariesPrintVersion builds every command the way releases are built
// (`make build`, whose LDFLAGS the Dockerfile uses too) with a given VERSION
// and COMMIT, and runs each with --version.
func TestBinariesPrintVersion(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	cmds, err := os.ReadDir(filepath.Join(root, "cmd"))
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	// A bound against a hung build, not a timing assertion: the release
	// build links every command afresh and, beside the race-built tests
	// of the other packages on a loaded 2-core machine, once took over 8
	// minutes.
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	const ver, commit = "v9.8.7-test", "0123456789abcdef0123456789abcdef01234567"
	mk := exec.CommandContext(ctx, "make", "-s", "build", "BIN="+bin, "VERSION="+ver, "COMMIT="+commit)
	mk.Dir = root
	if out, err := mk.CombinedOutput(); err != nil {
		t.Fatalf("make build: %v\n%s", err, out)
	}
	n := 0
	for _, c := range cmds {
		// cmd/internal holds the binaries' shared code (cmd/internal/cli), not a binary.
		if !c.IsDir() || c.Name() == "internal" {
			continue
		}
		n++
		name := c.Name()
		// Every command is built by `make build` (BINARIES lists them all).
		out, err := exec.CommandContext(ctx, filepath.Join(bin, name), "--version").CombinedOutput()
		if err != nil {
			t.Errorf("%s --version: %v\n%s", name, err, out)
			continue
		}
		want := name + " " + ver + " (commit " + commit + ", go"
		if !strings.HasPrefix(string(out), want) || strings.Count(string(out), "\n") != 1 {
			t.Errorf("%s --version printed %q, want one line starting %q", name, out, want)
		}
	}
	if n < 5 {
		t.Errorf("found %d commands under cmd/, want kvrouter, kvbridge, kvsim, kvbench, kvctl", n)
	}
}
