package workload

import (
	"fmt"
	"math"
	"testing"
)

func TestOverloadShares(t *testing.T) {
	c := Overload{Requests: 20_000}
	w, err := c.Generate(3)
	if err != nil {
		t.Fatal(err)
	}
	tokens := map[string]float64{}
	urgent := 0
	for _, r := range w.Requests {
		tokens[r.Tenant] += float64(r.InputTokens() + r.OutputTokens)
		if r.Priority == 0 {
			urgent++
		}
	}
	light := 0.0
	for i := range 9 {
		light += tokens[fmt.Sprintf("light-%d", i)]
	}
	if f := tokens[HeavyTenant] / (light / 9); f < 9 || f > 11 {
		t.Fatalf("heavy/light-tenant tokens = %.2f, want ~10", f)
	}
	if s := float64(urgent) / float64(len(w.Requests)); s < 0.23 || s > 0.27 {
		t.Fatalf("urgent share %.3f", s)
	}
	if m := c.MeanTokens(); math.Abs(m-(light+tokens[HeavyTenant])/float64(len(w.Requests)))/m > 0.05 {
		t.Fatalf("MeanTokens %.0f", m)
	}
	if _, err := (Overload{SystemTokens: 2000}).Generate(1); err == nil {
		t.Fatal("system prompt longer than the light prompt accepted")
	}
}
