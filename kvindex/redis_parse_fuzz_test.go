package kvindex

import (
	"errors"
	"strconv"
	"testing"
)

// renderPosition is a position as mapScript returns it: the sequence,
// then, when a hole is pending, a space and the hole's.
func renderPosition(p Position) string {
	s := strconv.FormatUint(p.Seq, 10)
	if p.Hole != 0 {
		s += " " + strconv.FormatUint(p.Hole, 10)
	}
	return s
}

// FuzzParsePosition: what the script renders parses back to itself, and
// whatever else Redis may hold parses to a position that renders and
// parses back the same (never a panic, never a hole without a position).
func FuzzParsePosition(f *testing.F) {
	for _, s := range []string{"", "0", "7", "7 9", "18446744073709551615 18446744073709551615", "7 x", " 7", "x 7", "-1", "7 9 11", "18446744073709551616"} {
		f.Add(s, uint64(0), uint64(0))
	}
	f.Add("", uint64(12), uint64(3))
	f.Fuzz(func(t *testing.T, s string, seq, hole uint64) {
		want := Position{Seq: seq, Seeded: true, Hole: hole}
		if got := parsePosition(renderPosition(want)); got != want {
			t.Fatalf("parsePosition(%q) = %+v, want %+v", renderPosition(want), got, want)
		}
		p := parsePosition(s)
		if !p.Seeded {
			if p != (Position{}) {
				t.Fatalf("parsePosition(%q) = %+v: unseeded with a sequence or a hole", s, p)
			}
			return
		}
		if again := parsePosition(renderPosition(p)); again != p {
			t.Fatalf("parsePosition(%q) = %+v renders %q, which parses to %+v", s, p, renderPosition(p), again)
		}
	})
}

// FuzzScriptStatus: any reply shape (a status, a position or something
// else in its place, more elements) is a known status or an error, never
// a panic; "stale" is errMoved.
func FuzzScriptStatus(f *testing.F) {
	for _, st := range []string{"ok", "dup", "owned", "yield", "behind", "stale", "", "OK", "weird"} {
		f.Add(st, "7 9", true, 0)
	}
	f.Add("ok", "", false, 3)
	f.Fuzz(func(t *testing.T, status, pos string, posIsString bool, extra int) {
		var reply []any
		if status != "" || extra > 0 {
			reply = append(reply, status)
			if posIsString {
				reply = append(reply, pos)
			} else {
				reply = append(reply, int64(len(pos)))
			}
			for range extra % 4 {
				reply = append(reply, "x")
			}
		}
		st, p, err := scriptStatus(reply)
		known := map[string]SeqStatus{"ok": SeqApplied, "dup": SeqDuplicate, "owned": SeqNotOwner, "yield": SeqYielded, "behind": SeqBehind}
		switch want, ok := known[status]; {
		case len(reply) == 0:
			if err == nil {
				t.Fatal("an empty reply parsed")
			}
		case ok:
			if err != nil || st != want {
				t.Fatalf("scriptStatus(%v) = %v, %v; want %v", reply, st, err, want)
			}
			if posIsString && p != parsePosition(pos) || !posIsString && p != (Position{}) {
				t.Fatalf("scriptStatus(%v) position %+v", reply, p)
			}
		case status == "stale":
			if !errors.Is(err, errMoved) {
				t.Fatalf("stale reply: %v, want errMoved", err)
			}
		default:
			if err == nil {
				t.Fatalf("status %q parsed as %v", status, st)
			}
		}
	})
}
