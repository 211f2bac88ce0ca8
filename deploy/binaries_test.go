package deploy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// repoRoot is the main module, which this module replaces in go.mod.
const repoRoot = ".."

// ourBinaries are the project's commands that the manifests run.
var ourBinaries = []string{"kvrouter", "kvbridge", "kvsim", "kvbench"}

// subcommands are the commands whose flags belong to a subcommand; their
// flag sets are keyed "<binary> <subcommand>".
var subcommands = map[string][]string{"kvbench": {"live"}}

// flagInfo is one flag of a binary, as its -h output prints it.
type flagInfo struct {
	name   string
	isBool bool // printed without a value placeholder
}

// binaries builds the commands once per test process (into a temp dir) and
// reads their flag sets from their own -h output: the flags the manifests
// pass are checked against what the binaries really accept.
type binaries struct {
	once  sync.Once
	err   error
	dir   string
	flags map[string]map[string]flagInfo
}

var bins binaries // lazily built; read-only after once.Do

func (b *binaries) get(t *testing.T) (dir string, flags map[string]map[string]flagInfo) {
	t.Helper()
	b.once.Do(func() {
		b.dir, b.err = os.MkdirTemp("", "kvrouter-deploy-bins-")
		if b.err != nil {
			return
		}
		b.flags, b.err = buildAndReadFlags(b.dir)
	})
	if b.err != nil {
		t.Fatalf("building the binaries: %v", b.err)
	}
	return b.dir, b.flags
}

func buildAndReadFlags(dir string) (map[string]map[string]flagInfo, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	args := []string{"build", "-o", dir + string(filepath.Separator)}
	for _, b := range ourBinaries {
		args = append(args, "./cmd/"+b)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	all := map[string]map[string]flagInfo{}
	for _, b := range ourBinaries {
		cmds := [][]string{{}}
		if subs, ok := subcommands[b]; ok {
			cmds = nil
			for _, sub := range subs {
				cmds = append(cmds, []string{sub})
			}
		}
		for _, sub := range cmds {
			c := exec.CommandContext(ctx, filepath.Join(dir, b), append(sub, "-h")...)
			out, _ := c.CombinedOutput() // -h exits non-zero in some commands; the listing is what counts
			fl := parseFlagUsage(out)
			key := strings.Join(append([]string{b}, sub...), " ")
			if len(fl) == 0 {
				return nil, fmt.Errorf("%s -h printed no flags:\n%s", key, out)
			}
			all[key] = fl
		}
	}
	return all, nil
}

// flagLine matches the first line of one flag in Go's flag.PrintDefaults:
// "  -name type" (or "  -name" for booleans; "  -x\tusage" for one-letter
// booleans).
var flagLine = regexp.MustCompile(`^  -([^\s=]+?)(?: (\S+))?(?:\t.*)?$`)

func parseFlagUsage(out []byte) map[string]flagInfo {
	fl := map[string]flagInfo{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		m := flagLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		fl[m[1]] = flagInfo{name: m[1], isBool: m[2] == ""}
	}
	return fl
}

// checkArgs checks a command line for binary bin: every flag exists, is
// written --name=value (or --name for booleans, so a following word can
// never be mistaken for its value), and no positional arguments are passed
// (the binaries reject them).
func checkArgs(t *testing.T, where, bin string, args []string) {
	t.Helper()
	_, flags := bins.get(t)
	fl, ok := flags[bin]
	if !ok {
		t.Errorf("%s: unknown binary %q", where, bin)
		return
	}
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			t.Errorf("%s: %s: positional argument %q (the binary rejects them; use --flag=value)", where, bin, a)
			continue
		}
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		f, ok := fl[name]
		if !ok {
			t.Errorf("%s: %s has no flag --%s (from %q)", where, bin, name, a)
			continue
		}
		if !f.isBool && !hasValue {
			t.Errorf("%s: %s --%s takes a value: write --%s=VALUE", where, bin, name, name)
		}
	}
}

// argValue returns the value of --name=value in args.
func argValue(args []string, name string) (string, bool) {
	for _, a := range args {
		n, v, ok := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if ok && n == name && strings.HasPrefix(a, "-") {
			return v, true
		}
	}
	return "", false
}

// binaryOf names the project binary a container runs, or "".
func binaryOf(command []string) string {
	if len(command) == 0 {
		return ""
	}
	base := filepath.Base(command[0])
	for _, b := range ourBinaries {
		if base == b {
			return b
		}
	}
	return ""
}

// envReadBy reports whether the command's source reads the environment
// variable: its name appears as a string literal in cmd/<bin>.
func envReadBy(t *testing.T, bin, name string) bool {
	t.Helper()
	bin, _, _ = strings.Cut(bin, " ") // a subcommand's source is its binary's
	files, err := filepath.Glob(filepath.Join(repoRoot, "cmd", bin, "*.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no sources for cmd/%s: %v", bin, err)
	}
	lit := []byte(`"` + name + `"`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(b, lit) {
			return true
		}
	}
	return false
}

func TestParseFlagUsage(t *testing.T) {
	out := []byte("usage: x [flags]\n" +
		"  -check-config\n    \tvalidate and exit\n" +
		"  -config string\n    \tpath\n" +
		"  -d\tone-letter bool\n" +
		"  -n int\n    \tcount (default 1)\n" +
		"  -shutdown-timeout duration\n    \tdrain (default 30s)\n")
	got := parseFlagUsage(out)
	want := map[string]bool{"check-config": true, "config": false, "d": true, "n": false, "shutdown-timeout": false}
	if len(got) != len(want) {
		t.Fatalf("got %d flags %v, want %d", len(got), got, len(want))
	}
	for n, isBool := range want {
		if f, ok := got[n]; !ok || f.isBool != isBool {
			t.Errorf("flag %s: got %+v (present %v), want bool=%v", n, f, ok, isBool)
		}
	}
}

// TestBinaryFlagsRead makes sure the -h parsing sees the flags the
// manifests rely on, so that a broken parser cannot pass every check.
func TestBinaryFlagsRead(t *testing.T) {
	_, flags := bins.get(t)
	for _, tc := range []struct {
		bin, flag string
		isBool    bool
	}{
		{"kvrouter", "config", false},
		{"kvrouter", "check-config", true},
		{"kvbridge", "nats-url", false},
		{"kvbridge", "zmq-bind", true},
		{"kvsim", "zmq-port", false},
		{"kvbench live", "router", false},
		{"kvbench live", "reset", true},
	} {
		f, ok := flags[tc.bin][tc.flag]
		if !ok || f.isBool != tc.isBool {
			t.Errorf("%s --%s: got %+v (present %v), want bool=%v", tc.bin, tc.flag, f, ok, tc.isBool)
		}
	}
}
