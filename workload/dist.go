package workload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// Arrivals says when requests arrive.
type Arrivals struct {
	// Rate is the mean arrival rate (requests per second) of a Poisson
	// process. Zero means the generator's documented default.
	Rate float64 `json:"rate,omitempty" yaml:"rate"`
	// Concurrency > 0 makes the workload closed-loop: the driver keeps this
	// many requests in flight and Rate is ignored.
	Concurrency int `json:"concurrency,omitempty" yaml:"concurrency"`
}

func (a Arrivals) withDefault(rate float64) Arrivals {
	zero.Default(&a.Rate, rate)
	return a
}

func (a Arrivals) validate(what string) error {
	if a.Rate < 0 || math.IsNaN(a.Rate) || math.IsInf(a.Rate, 0) {
		return fmt.Errorf("%w: %s: arrival rate %v must be positive", ErrInvalid, what, a.Rate)
	}
	if a.Concurrency < 0 {
		return fmt.Errorf("%w: %s: concurrency %d must be >= 0", ErrInvalid, what, a.Concurrency)
	}
	return nil
}

// poisson returns successive arrival times of a Poisson process at rate per second.
type poisson struct {
	rng  *rand.Rand
	rate float64
	t    float64
}

func (p *poisson) next() time.Duration {
	p.t += p.rng.ExpFloat64() / p.rate
	return time.Duration(p.t * float64(time.Second))
}

// exp draws an exponential duration with the given mean.
func expDur(rng *rand.Rand, mean time.Duration) time.Duration {
	return time.Duration(rng.ExpFloat64() * float64(mean))
}

// LengthDist is a log-normal token-length distribution truncated to
// [Min, Max] by resampling (as vLLM's ShareGPT sampler drops pairs out of
// range), whose location is solved so that the mean of the truncated
// distribution equals Mean.
type LengthDist struct {
	Mean  float64 `json:"mean" yaml:"mean"`
	Sigma float64 `json:"sigma" yaml:"sigma"`
	Min   int     `json:"min" yaml:"min"`
	Max   int     `json:"max" yaml:"max"`
}

func (d LengthDist) validate(what string) error {
	if d.Sigma <= 0 || d.Min < 1 || d.Max < d.Min || d.Mean <= float64(d.Min) || d.Mean >= float64(d.Max) {
		return fmt.Errorf("%w: %s: length distribution %+v needs sigma > 0, 1 <= min < mean < max", ErrInvalid, what, d)
	}
	return nil
}

func phi(x float64) float64 { return 0.5 * (1 + math.Erf(x/math.Sqrt2)) }

// truncMean is the mean of LogNormal(mu, sigma) restricted to [a, b].
func truncMean(mu, s, a, b float64) float64 {
	la, lb := math.Log(a), math.Log(b)
	num := phi((lb-mu-s*s)/s) - phi((la-mu-s*s)/s)
	den := phi((lb-mu)/s) - phi((la-mu)/s)
	if den <= 0 {
		return math.NaN()
	}
	return math.Exp(mu+s*s/2) * num / den
}

// sampler draws from a LengthDist.
type sampler struct {
	d  LengthDist
	mu float64
}

func newSampler(d LengthDist) sampler {
	// The truncated mean is increasing in mu: bisect.
	lo, hi := math.Log(float64(d.Min))-10*d.Sigma, math.Log(float64(d.Max))+10*d.Sigma
	for i := 0; i < 200; i++ {
		mid := (lo + hi) / 2
		m := truncMean(mid, d.Sigma, float64(d.Min), float64(d.Max)+0.5)
		if math.IsNaN(m) || m < d.Mean {
			lo = mid
		} else {
			hi = mid
		}
	}
	return sampler{d: d, mu: (lo + hi) / 2}
}

func (s sampler) draw(rng *rand.Rand) int {
	for i := 0; i < 1000; i++ {
		x := math.Exp(s.mu + s.d.Sigma*rng.NormFloat64())
		n := int(math.Round(x))
		if n >= s.d.Min && n <= s.d.Max {
			return n
		}
	}
	return int(math.Round(s.d.Mean))
}

func newRNG(seed int64, stream string) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(seed), derive(0, stream, 0)))
}

// zipf draws document ranks 0..n-1 with P(k) ∝ 1/(k+1)^s.
type zipf struct{ z *rand.Zipf }

func newZipf(rng *rand.Rand, s float64, n int) zipf {
	return zipf{z: rand.NewZipf(rng, s, 1, uint64(n-1))}
}

func (z zipf) draw() int { return int(z.z.Uint64()) }
