package archtest

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// sizeLimit is docs/architecture.md's bound: a package over it needs a
// written reason there.
const sizeLimit = 3000

// sizeSlack and sizeSlackLines are how far the package map's line counts
// may drift from the tree (the larger of the two) before the doc has to be
// brought up to date.
const (
	sizeSlack      = 0.10
	sizeSlackLines = 50
)

// TestPackageSizes checks docs/architecture.md's package map against the
// tree: every package's non-test Go lines (generated files apart) within
// sizeSlack of the count in its row, and each package over sizeLimit
// lines named in a paragraph that gives its reason ("`pkg` is … lines").
func TestPackageSizes(t *testing.T) {
	root := repoRoot(t)
	doc, err := os.ReadFile(filepath.Join(root, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]int{}
	row := regexp.MustCompile("(?m)^\\| `([a-z0-9/]+)` \\|.*\\| ([0-9][0-9,]*) \\|$")
	for _, m := range row.FindAllSubmatch(doc, -1) {
		n, err := strconv.Atoi(strings.ReplaceAll(string(m[2]), ",", ""))
		if err != nil {
			t.Fatalf("row %s: %v", m[1], err)
		}
		rows[string(m[1])] = n
	}
	if len(rows) < 20 {
		t.Fatalf("read %d rows of the package map; the table's shape changed?", len(rows))
	}
	for pkg, want := range rows {
		got := packageLines(t, filepath.Join(root, pkg))
		if got == 0 {
			t.Errorf("docs/architecture.md names `%s`, which has no Go files", pkg)
			continue
		}
		if d := max(got-want, want-got); d > sizeSlackLines && float64(d) > sizeSlack*float64(want) {
			t.Errorf("`%s`: the package map says %d lines, the tree has %d (more than %.0f%% and %d lines apart): update docs/architecture.md", pkg, want, got, sizeSlack*100, sizeSlackLines)
		}
		if got > sizeLimit && !bytes.Contains(doc, []byte("`"+pkg+"` is ")) {
			t.Errorf("`%s` has %d lines, over %d, and docs/architecture.md gives no reason (a paragraph \"`%s` is …\")", pkg, got, sizeLimit, pkg)
		}
	}
}

// packageLines counts the lines of a directory's non-test, non-generated
// Go files (not its sub-packages).
func packageLines(t *testing.T, dir string) int {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if generated.Match(data) {
			continue
		}
		n += bytes.Count(data, []byte("\n"))
	}
	return n
}

// generated is Go's marker of a generated file.
var generated = regexp.MustCompile(`(?m)^// Code generated .* DO NOT EDIT\.$`)

// repoRoot is the module's root: the test runs in internal/archtest.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root: %v", err)
	}
	return root
}
