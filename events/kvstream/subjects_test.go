package kvstream

import (
	"errors"
	"strings"
	"testing"
)

func TestSubjects(t *testing.T) {
	tests := []struct {
		name           string
		pool, instance string
		wantErr        bool
	}{
		{"plain", "llama", "vllm-0", false},
		{"underscore", "pool_a", "pod_1-dp1", false},
		{"dot in pool", "a.b", "x", true},
		{"dot in instance", "p", "10.0.0.1", true},
		{"wildcard star", "p", "*", true},
		{"wildcard gt", ">", "x", true},
		{"space", "p", "a b", true},
		{"tab", "p", "a\tb", true},
		{"empty pool", "", "x", true},
		{"empty instance", "p", "", true},
		{"too long", "p", strings.Repeat("a", MaxTokenLen+1), true},
		{"max len", "p", strings.Repeat("a", MaxTokenLen), false},
		{"non ascii", "p", "pöd", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, f := range []struct {
				root string
				fn   func(string, string) (string, error)
			}{{SubjectEvents, EventsSubject}, {SubjectEvictions, EvictionsSubject}, {SubjectInstances, InstancesSubject}, {SubjectSnapshot, SnapshotSubject}} {
				s, err := f.fn(tc.pool, tc.instance)
				if tc.wantErr {
					if !errors.Is(err, ErrBadToken) {
						t.Fatalf("%s: err = %v, want ErrBadToken", f.root, err)
					}
					continue
				}
				if err != nil {
					t.Fatalf("%s: %v", f.root, err)
				}
				if want := f.root + "." + tc.pool + "." + tc.instance; s != want {
					t.Fatalf("subject = %q, want %q", s, want)
				}
				root, p, in, err := ParseSubject(s)
				if err != nil || root != f.root || p != tc.pool || in != tc.instance {
					t.Fatalf("ParseSubject(%q) = %q %q %q %v", s, root, p, in, err)
				}
			}
		})
	}
}

func TestParseSubjectRejects(t *testing.T) {
	for _, s := range []string{"", "kv", "kv.events", "kv.events.", "kv.events.p", "kv.events.p.", "kv.events.p.i.extra", "kv.other.p.i", "kv.eventsx.p.i", "kv.events.*.i"} {
		if _, _, _, err := ParseSubject(s); !errors.Is(err, ErrBadSubject) {
			t.Errorf("ParseSubject(%q) err = %v, want ErrBadSubject", s, err)
		}
	}
}

func TestPoolSubjects(t *testing.T) {
	if s, err := PoolSubjects(SubjectEvents, "llama"); err != nil || s != "kv.events.llama.>" {
		t.Fatalf("got %q %v", s, err)
	}
	if s, err := PoolSubjects(SubjectInstances, ""); err != nil || s != "kv.instances.>" {
		t.Fatalf("got %q %v", s, err)
	}
	if _, err := PoolSubjects(SubjectEvents, "a.b"); !errors.Is(err, ErrBadToken) {
		t.Fatalf("err = %v", err)
	}
}

func FuzzParseSubject(f *testing.F) {
	for _, s := range []string{"kv.events.p.i", "kv.snapshot.pool_1.vllm-0", "kv.events..", "kv.instances.a.b.c", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		root, p, in, err := ParseSubject(s)
		if err != nil {
			return
		}
		// Anything accepted must round-trip through the builders.
		if ValidToken("pool", p) != nil || ValidToken("instance", in) != nil {
			t.Fatalf("accepted invalid tokens %q %q", p, in)
		}
		if got := root + "." + p + "." + in; got != s {
			t.Fatalf("round trip %q != %q", got, s)
		}
	})
}
