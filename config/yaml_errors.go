package config

import (
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// YAML decoding errors name Go types ("field concurency_threshold not found
// in type router.RoutingConfig", "cannot unmarshal !!int `5` into
// time.Duration"). explainYAML rewrites them in the file's own terms: the
// YAML path of the offending key, the closest known field name, and how to
// write a duration.

var (
	yamlLineRe    = regexp.MustCompile(`^line (\d+): (.*)$`)
	yamlUnknownRe = regexp.MustCompile(`^field (\S+) not found in type `)
	yamlTypeRe    = regexp.MustCompile("^cannot unmarshal !!(\\w+) `(.*)` into (\\S+)$")
)

var durationType = reflect.TypeOf(time.Duration(0))

// explainYAML returns err with each of a *yaml.TypeError's messages
// rewritten against doc, the document that failed to decode into a value of
// type root; any other error is returned as it is.
func explainYAML(doc []byte, root reflect.Type, err error) error {
	var te *yaml.TypeError
	if !errors.As(err, &te) {
		return err
	}
	var tree yaml.Node
	if yaml.Unmarshal(doc, &tree) != nil {
		return err
	}
	msgs := make([]string, len(te.Errors))
	for i, m := range te.Errors {
		msgs[i] = explainYAMLMessage(&tree, root, m)
	}
	return errors.New(strings.Join(msgs, "; "))
}

func explainYAMLMessage(tree *yaml.Node, root reflect.Type, msg string) string {
	lm := yamlLineRe.FindStringSubmatch(msg)
	if lm == nil {
		return msg
	}
	line, _ := strconv.Atoi(lm[1])
	rest := lm[2]
	if um := yamlUnknownRe.FindStringSubmatch(rest); um != nil {
		path, ok := findYAMLKey(tree, line, um[1])
		if !ok {
			return msg
		}
		out := fmt.Sprintf("line %d: %s: unknown field", line, joinYAMLPath(path))
		if s := closestField(fieldsAt(root, path[:len(path)-1]), um[1]); s != "" {
			out += fmt.Sprintf(" (did you mean %q?)", s)
		}
		return out
	}
	if tm := yamlTypeRe.FindStringSubmatch(rest); tm != nil {
		path, ok := findYAMLValue(tree, line, tm[2])
		if !ok {
			return msg
		}
		where := joinYAMLPath(path)
		if t := typeAt(root, path); t == durationType || tm[3] == "time.Duration" {
			return fmt.Sprintf("line %d: %s: %q is not a duration: write a number with a unit, e.g. \"%ss\" or \"250ms\"", line, where, tm[2], tm[2])
		}
		return fmt.Sprintf("line %d: %s: cannot use %s %q here (want %s)", line, where, tm[1], tm[2], yamlKind(typeAt(root, path), tm[3]))
	}
	return msg
}

// findYAMLKey returns the path to the mapping key named key on line.
func findYAMLKey(n *yaml.Node, line int, key string) ([]string, bool) {
	return walkYAML(n, nil, func(k, _ *yaml.Node) bool { return k.Line == line && k.Value == key }, true)
}

// findYAMLValue returns the path to the scalar value on line.
func findYAMLValue(n *yaml.Node, line int, value string) ([]string, bool) {
	return walkYAML(n, nil, func(_, v *yaml.Node) bool {
		return v.Kind == yaml.ScalarNode && v.Line == line && v.Value == value
	}, false)
}

// walkYAML searches n depth first; match sees each mapping key with its
// value (key nil for a sequence item). The path ends at the matching key.
func walkYAML(n *yaml.Node, path []string, match func(k, v *yaml.Node) bool, keysOnly bool) ([]string, bool) {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if p, ok := walkYAML(c, path, match, keysOnly); ok {
				return p, true
			}
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := append(append([]string(nil), path...), k.Value)
			if match(k, v) {
				return p, true
			}
			if q, ok := walkYAML(v, p, match, keysOnly); ok {
				return q, true
			}
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			p := append(append([]string(nil), path...), "["+strconv.Itoa(i)+"]")
			if !keysOnly && match(&yaml.Node{}, c) {
				return p, true
			}
			if q, ok := walkYAML(c, p, match, keysOnly); ok {
				return q, true
			}
		}
	}
	return nil, false
}

func joinYAMLPath(path []string) string {
	var b strings.Builder
	for _, p := range path {
		if b.Len() > 0 && !strings.HasPrefix(p, "[") {
			b.WriteByte('.')
		}
		b.WriteString(p)
	}
	return b.String()
}

// typeAt follows a YAML path through root's yaml tags; nil when the path
// leaves the type.
func typeAt(t reflect.Type, path []string) reflect.Type {
	for _, p := range path {
		for t != nil && (t.Kind() == reflect.Pointer) {
			t = t.Elem()
		}
		if t == nil {
			return nil
		}
		if strings.HasPrefix(p, "[") {
			if t.Kind() != reflect.Slice && t.Kind() != reflect.Array {
				return nil
			}
			t = t.Elem()
			continue
		}
		switch t.Kind() {
		case reflect.Map:
			t = t.Elem()
		case reflect.Struct:
			f, ok := yamlField(t, p)
			if !ok {
				return nil
			}
			t = f
		default:
			return nil
		}
	}
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

// yamlFields calls fn with each YAML key of struct type t and the type it
// decodes into, inline structs flattened, until fn returns false.
func yamlFields(t reflect.Type, fn func(key string, ft reflect.Type) bool) bool {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if strings.Contains(opts, "inline") {
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if !yamlFields(ft, fn) {
				return false
			}
			continue
		}
		if name == "-" || !f.IsExported() {
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		if !fn(name, f.Type) {
			return false
		}
	}
	return true
}

// yamlField finds the type a YAML key of struct type t decodes into.
func yamlField(t reflect.Type, key string) (ft reflect.Type, ok bool) {
	yamlFields(t, func(k string, typ reflect.Type) bool {
		if k == key {
			ft, ok = typ, true
		}
		return !ok
	})
	return ft, ok
}

// fieldsAt lists the YAML keys of the struct at path.
func fieldsAt(root reflect.Type, path []string) []string {
	t := typeAt(root, path)
	if t == nil || t.Kind() != reflect.Struct {
		return nil
	}
	var out []string
	yamlFields(t, func(k string, _ reflect.Type) bool { out = append(out, k); return true })
	return out
}

// closestField is the known name nearest to got by edit distance when it is
// near enough to be a typo: at most a third of got's length, and at least
// one edit, so "concurency_threshold" finds "concurrency_threshold" while
// "foo" suggests nothing.
func closestField(known []string, got string) string {
	best, bestD := "", max(1, len(got)/3)+1
	for _, k := range known {
		if d := editDistance(k, got); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

// editDistance is the optimal-string-alignment distance between a and b
// (bytes): insertions, deletions, substitutions and swaps of two adjacent
// bytes, the usual typos ("modle"), cost one each.
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}

// yamlKind names what a field of type t wants, in YAML words.
func yamlKind(t reflect.Type, goName string) string {
	if t == nil {
		return goName
	}
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "a list"
	case reflect.Map, reflect.Struct:
		return "a mapping"
	}
	return goName
}
