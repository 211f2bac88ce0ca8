package workload

import (
	"fmt"
	"math"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// Overload is a flow-control workload: one heavy tenant beside light ones,
// two priorities, and a TTFT objective on every request, arriving as a
// Poisson burst. Its arrival rate is meant to be set from the fleet's
// measured capacity (kvbench flow runs it at multiples of it).
type Overload struct {
	// LightTenants (default 9) send chats: LightPromptTokens (default
	// 1,000, of which SystemTokens are the tenant's own system prompt) and
	// LightOutputTokens (default 100).
	LightTenants      int `json:"light_tenants,omitempty" yaml:"light_tenants"`
	LightPromptTokens int `json:"light_prompt_tokens,omitempty" yaml:"light_prompt_tokens"`
	LightOutputTokens int `json:"light_output_tokens,omitempty" yaml:"light_output_tokens"`
	// The heavy tenant sends long prompts (default 10,000 tokens, 100 out)
	// and HeavyFactor (default 10) times the tokens of one light tenant.
	HeavyPromptTokens int     `json:"heavy_prompt_tokens,omitempty" yaml:"heavy_prompt_tokens"`
	HeavyOutputTokens int     `json:"heavy_output_tokens,omitempty" yaml:"heavy_output_tokens"`
	HeavyFactor       float64 `json:"heavy_factor,omitempty" yaml:"heavy_factor"`
	// SystemTokens is each tenant's system prompt (default 500).
	SystemTokens int `json:"system_tokens,omitempty" yaml:"system_tokens"`
	// UrgentShare of the requests are priority 0 ("high"), the rest
	// priority 1 ("low"), drawn independently of the tenant (default 0.25;
	// < 0 for none).
	UrgentShare float64 `json:"urgent_share,omitempty" yaml:"urgent_share"`
	// TTFTObjective is every request's objective (0 = none).
	TTFTObjective time.Duration `json:"ttft_objective,omitempty" yaml:"ttft_objective"`
	// Requests (default 3,000). Arrivals: Poisson, default 10 req/s.
	Requests int      `json:"requests,omitempty" yaml:"requests"`
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

// HeavyTenant is the heavy tenant's key; light tenants are "light-0"...
const HeavyTenant = "heavy"

func (c Overload) withDefaults() Overload {
	zero.Default(&c.LightTenants, 9)
	zero.Default(&c.LightPromptTokens, 1000)
	zero.Default(&c.LightOutputTokens, 100)
	zero.Default(&c.HeavyPromptTokens, 10000)
	zero.Default(&c.HeavyOutputTokens, 100)
	zero.Default(&c.HeavyFactor, 10)
	zero.Default(&c.SystemTokens, 500)
	zero.Default(&c.UrgentShare, 0.25)
	zero.Default(&c.Requests, 3000)
	c.Arrivals = c.Arrivals.withDefault(10)
	return c
}

// MeanTokens is the mean prompt-plus-output tokens of a request.
func (c Overload) MeanTokens() float64 {
	c = c.withDefaults()
	pl, ph := c.shares()
	light := float64(c.LightPromptTokens + c.LightOutputTokens)
	heavy := float64(c.HeavyPromptTokens + c.HeavyOutputTokens)
	return pl*float64(c.LightTenants)*light + ph*heavy
}

// shares are the probabilities that a request is one light tenant's, and
// the heavy tenant's: the heavy tenant's token rate is HeavyFactor times
// one light tenant's.
func (c Overload) shares() (light, heavy float64) {
	lt := float64(c.LightPromptTokens + c.LightOutputTokens)
	ht := float64(c.HeavyPromptTokens + c.HeavyOutputTokens)
	rh := c.HeavyFactor * lt / ht // heavy requests per light tenant's request
	total := float64(c.LightTenants) + rh
	return 1 / total, rh / total
}

// Generate builds the workload; the same seed gives the same workload.
func (c Overload) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "overload"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"light_tenants": c.LightTenants, "light_prompt_tokens": c.LightPromptTokens,
		"light_output_tokens": c.LightOutputTokens, "heavy_prompt_tokens": c.HeavyPromptTokens,
		"heavy_output_tokens": c.HeavyOutputTokens, "system_tokens": c.SystemTokens, "requests": c.Requests},
		invalidIf(c.SystemTokens >= min(c.LightPromptTokens, c.HeavyPromptTokens), name,
			fmt.Sprintf("system_tokens %d must be under both prompt lengths", c.SystemTokens)),
		invalidIf(!(c.HeavyFactor > 0) || math.IsInf(c.HeavyFactor, 0) || !(c.UrgentShare <= 1) || c.TTFTObjective < 0, name,
			"heavy_factor > 0, urgent_share <= 1, ttft_objective >= 0"))
	if err != nil {
		return nil, err
	}
	rng := run.rng
	arr := run.poisson(c.Arrivals.Rate)
	_, heavy := c.shares()
	for i := 0; i < c.Requests; i++ {
		tenant, tn := HeavyTenant, uint64(c.LightTenants)
		prompt, out := c.HeavyPromptTokens, c.HeavyOutputTokens
		if rng.Float64() >= heavy {
			t := rng.IntN(c.LightTenants)
			tenant, tn = fmt.Sprintf("light-%d", t), uint64(t)
			prompt, out = c.LightPromptTokens, c.LightOutputTokens
		}
		prio := int64(1)
		if rng.Float64() < c.UrgentShare {
			prio = 0
		}
		run.ask(Request{At: arr.next(), Tenant: tenant, Priority: prio, TTFTObjective: c.TTFTObjective, OutputTokens: out},
			run.seg("system", tn, c.SystemTokens, "system"), uint64(i), prompt-c.SystemTokens)
	}
	return run.w.finish(), nil
}
