package deploy

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// dockerfile is deploy/Dockerfile reduced to what the checks need.
type dockerfile struct {
	stages []dockerStage
}

type dockerStage struct {
	from, name string
	args       map[string]string // ARG name -> default
	runs       []string          // RUN commands, --mount options removed
	copies     []string          // COPY instructions, as written
	user       string
}

// instruction joins continuation lines and drops comments.
func parseDockerfile(t *testing.T, text string) dockerfile {
	t.Helper()
	var df dockerfile
	var lines []string
	var cur strings.Builder
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(l, "#") || l == "" {
			continue
		}
		if s, ok := strings.CutSuffix(l, "\\"); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(l)
		lines = append(lines, cur.String())
		cur.Reset()
	}
	mount := regexp.MustCompile(`--mount=\S+\s*`)
	for _, l := range lines {
		op, rest, _ := strings.Cut(l, " ")
		rest = strings.TrimSpace(rest)
		if strings.ToUpper(op) == "FROM" {
			st := dockerStage{args: map[string]string{}}
			f := strings.Fields(rest)
			st.from = f[0]
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				st.name = f[2]
			}
			df.stages = append(df.stages, st)
			continue
		}
		if len(df.stages) == 0 {
			t.Fatalf("Dockerfile: %q before FROM", l)
		}
		st := &df.stages[len(df.stages)-1]
		switch strings.ToUpper(op) {
		case "ARG":
			n, v, _ := strings.Cut(rest, "=")
			st.args[n] = v
		case "RUN":
			st.runs = append(st.runs, strings.TrimSpace(mount.ReplaceAllString(rest, "")))
		case "COPY":
			st.copies = append(st.copies, rest)
		case "USER":
			st.user = rest
		}
	}
	return df
}

// makeVar returns the value a Makefile assigns to name (=, :=, ?=).
func makeVar(t *testing.T, makefile, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s*[:?]?=\s*(.*)$`).FindStringSubmatch(makefile)
	if m == nil {
		t.Fatalf("Makefile: no %s", name)
	}
	return strings.TrimSpace(m[1])
}

func readRepoFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestDockerfile: a multi-stage build whose build stage uses the Go of
// go.mod and builds with `make build` (the Makefile's flags, every command,
// version stamped from the ARGs `make image` passes), and whose runtime stage
// is distroless and runs as a numeric non-root user.
func TestDockerfile(t *testing.T) {
	df := parseDockerfile(t, readRepoFile(t, "deploy/Dockerfile"))
	if len(df.stages) != 2 {
		t.Fatalf("want a build and a runtime stage, have %d", len(df.stages))
	}
	build, runtime := df.stages[0], df.stages[1]
	m := regexp.MustCompile(`(?m)^go (\S+)$`).FindStringSubmatch(readRepoFile(t, "go.mod"))
	if m == nil {
		t.Fatal("no go line in go.mod")
	}
	if want := "golang:" + m[1] + "-bookworm"; build.from != want {
		t.Errorf("build stage FROM %s, want %s (go.mod)", build.from, want)
	}
	if len(build.runs) == 0 || !strings.HasPrefix(build.runs[len(build.runs)-1], "make build BIN=/out ") {
		t.Errorf("the build stage must build with `make build BIN=/out` (the Makefile's flags); runs %q", build.runs)
	}
	for _, a := range []string{"VERSION", "COMMIT"} {
		if _, ok := build.args[a]; !ok {
			t.Errorf("build stage: no ARG %s", a)
		}
	}
	if !slices.Contains(runtime.copies, "--from="+build.name+" /out/ /usr/local/bin/") {
		t.Errorf("runtime stage must copy /out/ of %s into /usr/local/bin/: %q", build.name, runtime.copies)
	}
	if !strings.HasPrefix(runtime.from, "gcr.io/distroless/static") || !strings.HasSuffix(runtime.from, ":nonroot") {
		t.Errorf("runtime stage FROM %s: want distroless static, nonroot", runtime.from)
	}
	uid, _, _ := strings.Cut(runtime.user, ":")
	if uid == "" || uid == "0" || strings.Trim(uid, "0123456789") != "" {
		t.Errorf("USER %q: want a numeric non-root uid (runAsNonRoot can verify only a number)", runtime.user)
	}

	mk := readRepoFile(t, "Makefile")
	cmds, err := os.ReadDir(filepath.Join(repoRoot, "cmd"))
	if err != nil {
		t.Fatal(err)
	}
	binaries := strings.Fields(makeVar(t, mk, "BINARIES"))
	for _, c := range cmds {
		// cmd/internal holds the binaries' shared code (cmd/internal/cli), not a binary.
		if c.IsDir() && c.Name() != "internal" && !slices.Contains(binaries, c.Name()) {
			t.Errorf("Makefile BINARIES does not build ./cmd/%s", c.Name())
		}
	}
	// What `make image` runs (make -n prints it without running docker).
	cmd := exec.Command("make", "-s", "-n", "image", "VERSION=v1.2.3", "COMMIT=abc123")
	cmd.Dir = repoRoot
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make -n image: %v", err)
	}
	got := strings.Join(strings.Fields(strings.ReplaceAll(string(out), "\\\n", " ")), " ")
	// BuildKit reads the RUN --mount cache mounts (Docker 20.10 needs it asked for).
	want := "DOCKER_BUILDKIT=1 docker build -f deploy/Dockerfile --build-arg VERSION=v1.2.3 --build-arg COMMIT=abc123 -t " +
		makeVar(t, mk, "IMAGE") + ":v1.2.3 ."
	if got != want {
		t.Errorf("make image runs\n  %s\nwant\n  %s", got, want)
	}
}

// TestDockerfileBuildStage runs the build stage's RUN command the way
// docker would, without docker: in a copy of the build context (the
// repository less .dockerignore's entries, so no .git), with the ARGs set.
// Every binary must come out static-enough to run and stamped with the
// ARGs' version and commit.
func TestDockerfileBuildStage(t *testing.T) {
	df := parseDockerfile(t, readRepoFile(t, "deploy/Dockerfile"))
	run := df.stages[0].runs[len(df.stages[0].runs)-1]
	ctxDir := t.TempDir()
	copyBuildContext(t, repoRoot, ctxDir, readRepoFile(t, "deploy/Dockerfile.dockerignore"))
	if _, err := os.Stat(filepath.Join(ctxDir, ".git")); err == nil {
		t.Fatal(".git is in the build context")
	}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "sh", "-c", strings.ReplaceAll(run, "BIN=/out", "BIN="+out))
	cmd.Dir = ctxDir
	const ver, commit = "v0.0.0-image-test", "feedc0de"
	cmd.Env = append(os.Environ(), "VERSION="+ver, "COMMIT="+commit)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", run, err, b)
	}
	for _, b := range strings.Fields(makeVar(t, readRepoFile(t, "Makefile"), "BINARIES")) {
		got, err := exec.CommandContext(ctx, filepath.Join(out, b), "--version").CombinedOutput()
		if err != nil || !strings.HasPrefix(string(got), b+" "+ver+" (commit "+commit+",") {
			t.Errorf("%s --version: %q %v", b, got, err)
		}
		// CGO_ENABLED=0: nothing for a distroless/static base to lack.
		elf, err := os.ReadFile(filepath.Join(out, b))
		if err == nil && bytes.Contains(elf, []byte("/lib64/ld-linux")) {
			t.Errorf("%s is dynamically linked; distroless/static has no libc", b)
		}
	}
}

// copyBuildContext copies src to dst less what the dockerignore patterns
// (top-level names and globs, as deploy/Dockerfile.dockerignore uses them)
// exclude.
func copyBuildContext(t *testing.T, src, dst, ignore string) {
	t.Helper()
	var pats []string
	for _, l := range strings.Split(ignore, "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			pats = append(pats, l)
		}
	}
	ignored := func(rel string) bool {
		for _, p := range pats {
			if ok, _ := filepath.Match(p, rel); ok {
				return true
			}
			if ok, _ := filepath.Match(p, filepath.Base(rel)); ok && !strings.Contains(p, "/") && strings.HasPrefix(p, "*") {
				return true
			}
		}
		return false
	}
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if rel == "." {
			return nil
		}
		if ignored(filepath.ToSlash(rel)) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		in, err := os.Open(p)
		if err != nil {
			return err
		}
		defer in.Close()
		o, err := os.Create(target)
		if err != nil {
			return err
		}
		if _, err := io.Copy(o, in); err != nil {
			o.Close()
			return err
		}
		return o.Close()
	})
	if err != nil {
		t.Fatal(err)
	}
}
