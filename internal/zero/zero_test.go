package zero

import (
	"testing"
	"time"
)

// A zero field takes the default; a set one, negative values included,
// keeps its own.
func TestDefault(t *testing.T) {
	for _, c := range []struct{ have, want int }{{0, 7}, {3, 3}, {-1, -1}} {
		v := c.have
		Default(&v, 7)
		if v != c.want {
			t.Errorf("Default(&%d, 7) = %d, want %d", c.have, v, c.want)
		}
	}
	d := time.Duration(0)
	Default(&d, time.Second)
	s := ""
	Default(&s, "x")
	f := 0.5
	Default(&f, 1.5)
	if d != time.Second || s != "x" || f != 0.5 {
		t.Errorf("got %v %q %v, want 1s \"x\" 0.5", d, s, f)
	}
}
