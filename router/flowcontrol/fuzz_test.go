package flowcontrol

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

func FuzzParsePriority(f *testing.F) {
	for _, s := range []string{"0", "-3", " 7 ", "+1", "", "x", "9223372036854775807", "-9223372036854775808", "9223372036854775808", "1.5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePriority(s)
		if err != nil {
			if !errors.Is(err, ErrSyntax) {
				t.Fatalf("error %v does not wrap ErrSyntax", err)
			}
			return
		}
		if q, err := ParsePriority(strconv.FormatInt(p, 10)); err != nil || q != p {
			t.Fatalf("%q -> %d does not round-trip", s, p)
		}
	})
}

func FuzzPriorityJSON(f *testing.F) {
	for _, s := range []string{"0", "-3", "null", "", "2.0", "1e2", "1.5", `"1"`, "+1", "1e400", "-0", "9007199254740993", "true", "[1]", ".5", "5."} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, ok, err := PriorityJSON(raw)
		switch {
		case err != nil:
			if ok || p != 0 || !errors.Is(err, ErrSyntax) {
				t.Fatalf("%q: %d %v %v", raw, p, ok, err)
			}
		case ok:
			if q, ok2, err := PriorityJSON([]byte(strconv.FormatInt(p, 10))); err != nil || !ok2 || q != p {
				t.Fatalf("%q -> %d does not round-trip", raw, p)
			}
		case p != 0:
			t.Fatalf("%q: absent but %d", raw, p)
		}
	})
}

func FuzzParseTTFTObjective(f *testing.F) {
	for _, s := range []string{"500", "0", "-1", "3600000", "3600001", " 20 ", "1e3", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseTTFTObjective(s)
		if err != nil {
			if !errors.Is(err, ErrSyntax) {
				t.Fatal(err)
			}
			return
		}
		if d <= 0 || d > MaxTTFTObjective || d%time.Millisecond != 0 {
			t.Fatalf("%q -> %v", s, d)
		}
	})
}

func TestParsers(t *testing.T) {
	for s, want := range map[string]int64{"0": 0, "-3": -3, " 12 ": 12, "+4": 4} {
		if got, err := ParsePriority(s); err != nil || got != want {
			t.Errorf("ParsePriority(%q) = %d, %v", s, got, err)
		}
	}
	for _, s := range []string{"", "x", "1.0", "9223372036854775808"} {
		if _, err := ParsePriority(s); err == nil {
			t.Errorf("ParsePriority(%q) accepted", s)
		}
	}
	for s, want := range map[string]int64{"0": 0, "-3": -3, "2.0": 2, "1e2": 100, "-0": 0} {
		if got, ok, err := PriorityJSON([]byte(s)); err != nil || !ok || got != want {
			t.Errorf("PriorityJSON(%q) = %d, %v, %v", s, got, ok, err)
		}
	}
	for _, s := range []string{"1.5", `"1"`, "true", "1e400", "+1"} {
		if _, _, err := PriorityJSON([]byte(s)); err == nil {
			t.Errorf("PriorityJSON(%q) accepted", s)
		}
	}
	if _, ok, err := PriorityJSON([]byte("null")); ok || err != nil {
		t.Error("null")
	}
	if d, err := ParseTTFTObjective("250"); err != nil || d != 250*time.Millisecond {
		t.Error(d, err)
	}
	for _, s := range []string{"0", "-5", "3600001", "1.5", ""} {
		if _, err := ParseTTFTObjective(s); err == nil {
			t.Errorf("ParseTTFTObjective(%q) accepted", s)
		}
	}
}
