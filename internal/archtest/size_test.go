package archtest

import (
	"bytes"
	"io/fs"
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

// mapHeader opens the package map's table in docs/architecture.md.
const mapHeader = "| package | owns | may import (project) | lines |"

// TestPackageSizes checks docs/architecture.md's package map against the
// tree: one row per package of the module (a `dir/*` row covers every
// package below dir, its count their total; a row's count "—" is not
// checked), no package without a row and no row twice; every count within
// sizeSlack (or sizeSlackLines) of the package's non-test Go lines, generated
// files apart; and each package over sizeLimit lines named in a paragraph
// that gives its reason ("`pkg` is … lines").
func TestPackageSizes(t *testing.T) {
	root := repoRoot(t)
	doc, err := os.ReadFile(filepath.Join(root, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	rows := packageMap(t, doc)
	pkgs := modulePackages(t, root)
	counted := map[string]int{} // row → the tree's lines under it
	for pkg, n := range pkgs {
		row := ""
		if _, ok := rows[pkg]; ok {
			row = pkg
		} else {
			for r := range rows {
				if dir, ok := strings.CutSuffix(r, "/*"); ok && strings.HasPrefix(pkg, dir+"/") && len(r) > len(row) {
					row = r
				}
			}
		}
		if row == "" {
			t.Errorf("package `%s` (%d lines) has no row in docs/architecture.md's package map", pkg, n)
			continue
		}
		counted[row] += n
		if n > sizeLimit && !bytes.Contains(doc, []byte("`"+pkg+"` is ")) {
			t.Errorf("`%s` has %d lines, over %d, and docs/architecture.md gives no reason (a paragraph \"`%s` is …\")", pkg, n, sizeLimit, pkg)
		}
	}
	for row, want := range rows {
		got, ok := counted[row]
		if !ok {
			t.Errorf("docs/architecture.md's package map names `%s`, which holds no package of the module", row)
			continue
		}
		if want < 0 {
			continue // "—"
		}
		if d := max(got-want, want-got); d > sizeSlackLines && float64(d) > sizeSlack*float64(want) {
			t.Errorf("`%s`: the package map says %d lines, the tree has %d (more than %.0f%% and %d lines apart): update docs/architecture.md", row, want, got, sizeSlack*100, sizeSlackLines)
		}
	}
}

// packageMap reads the package map's rows: package (or `dir/*`) → its line
// count, -1 for "—".
func packageMap(t *testing.T, doc []byte) map[string]int {
	t.Helper()
	i := bytes.Index(doc, []byte(mapHeader))
	if i < 0 {
		t.Fatalf("docs/architecture.md has no package map (%q)", mapHeader)
	}
	row := regexp.MustCompile("^\\| `([a-z0-9/]+(?:/\\*)?)` \\|.*\\| ([0-9][0-9,]*|—) \\|$")
	rows := map[string]int{}
	lines := strings.Split(string(doc[i:]), "\n")
	for _, line := range lines[2:] { // past the header and its rule
		if !strings.HasPrefix(line, "|") {
			break
		}
		m := row.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("a package map row not of the form | `pkg` | … | lines |: %.80s", line)
		}
		if _, dup := rows[m[1]]; dup {
			t.Errorf("`%s` has two rows in the package map", m[1])
		}
		n := -1
		if m[2] != "—" {
			var err error
			if n, err = strconv.Atoi(strings.ReplaceAll(m[2], ",", "")); err != nil {
				t.Fatalf("row %s: %v", m[1], err)
			}
		}
		rows[m[1]] = n
	}
	if len(rows) < 20 {
		t.Fatalf("read %d rows of the package map; the table's shape changed?", len(rows))
	}
	return rows
}

// modulePackages is every directory of the module holding non-test Go
// code (generated files apart), by path from the root, with its lines;
// directories of other modules (their own go.mod), testdata and hidden
// ones are left out.
func modulePackages(t *testing.T, root string) map[string]int {
	t.Helper()
	out := map[string]int{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		name := d.Name()
		if path != root {
			if strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor" || name == "node_modules" {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // another module
			}
		}
		if n := packageLines(t, path); n > 0 {
			rel, _ := filepath.Rel(root, path)
			out[filepath.ToSlash(rel)] = n
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
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
