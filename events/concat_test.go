package events

import (
	"bytes"
	"errors"
	"testing"
)

// Captured payloads joined unchanged split back into exactly themselves;
// a count that does not match, a cut value or trailing bytes fail.
func TestSplitValues(t *testing.T) {
	var ps [][]byte
	for _, c := range loadCaptures(t) {
		ps = append(ps, c.payload(t))
	}
	joined := bytes.Join(ps, nil)
	got, err := SplitValues(joined, len(ps), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(ps) {
		t.Fatalf("%d parts, want %d", len(got), len(ps))
	}
	for i := range ps {
		if !bytes.Equal(got[i], ps[i]) {
			t.Fatalf("part %d differs from the payload joined", i)
		}
		if _, err := Decode(got[i]); err != nil {
			t.Fatalf("part %d: %v", i, err)
		}
	}
	for _, bad := range []struct {
		name string
		p    []byte
		n    int
	}{
		{"too few values", joined, len(ps) + 1},
		{"too many values", joined, len(ps) - 1},
		{"cut", joined[:len(joined)-1], len(ps)},
		{"empty", nil, 1},
		{"zero wanted", joined, 0},
	} {
		if parts, err := SplitValues(bad.p, bad.n, nil); !errors.Is(err, ErrMalformed) || len(parts) != 0 {
			t.Errorf("%s: %d parts, err = %v, want none and ErrMalformed", bad.name, len(parts), err)
		}
	}
	// The decoder refuses a joined payload as a whole (what a reader
	// that does not know coalesced messages does with one).
	if _, err := Decode(joined); !errors.Is(err, ErrMalformed) {
		t.Fatalf("Decode of %d joined payloads: err = %v, want ErrMalformed", len(ps), err)
	}
}

// FuzzSplitValues: whatever the input, SplitValues returns ErrMalformed or
// exactly n parts that tile the input, each one complete msgpack value
// (splitting it alone gives itself).
func FuzzSplitValues(f *testing.F) {
	for _, c := range loadCaptures(f) {
		p := c.payload(f)
		f.Add(append(append([]byte(nil), p...), p...), 2)
	}
	f.Add([]byte{0x91, 0xc0, 0x90}, 2)
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff}, 1)
	f.Fuzz(func(t *testing.T, p []byte, n int) {
		if n > 64 {
			n %= 64
		}
		parts, err := SplitValues(p, n, nil)
		if err != nil {
			if !errors.Is(err, ErrMalformed) || len(parts) != 0 {
				t.Fatalf("%d parts with error %v, want none and ErrMalformed", len(parts), err)
			}
			return
		}
		if len(parts) != n || !bytes.Equal(bytes.Join(parts, nil), p) {
			t.Fatalf("%d parts do not tile the %d-byte input into %d", len(parts), len(p), n)
		}
		for i, q := range parts {
			if one, err := SplitValues(q, 1, nil); err != nil || !bytes.Equal(one[0], q) {
				t.Fatalf("part %d is not one value: %v", i, err)
			}
		}
	})
}
