package flowcontrol

import "time"

// svcFit is a least-squares line through (prompt tokens, admission to
// first token) over about the last estimatorWindow first tokens
// (exponentially weighted sums). The time from admission to first token is
// the engine's wait for the prefill already ahead of the request (bounded
// by the budgets, about the same for every request) plus its own prefill,
// which grows with its prompt: a 10,000-token prompt takes several of a
// 1,000-token one's steps. One average for both admits a long prompt too
// late to meet its deadline and sheds a short one that would have; the
// line predicts each from its own length.
type svcFit struct {
	n, x, y, xx, xy float64
}

func (f *svcFit) add(x, y float64) {
	const keep = 1 - 1.0/estimatorWindow
	f.n = f.n*keep + 1
	f.x = f.x*keep + x
	f.y = f.y*keep + y
	f.xx = f.xx*keep + x*x
	f.xy = f.xy*keep + x*y
}

// at is the predicted service time for a prompt of x tokens (0 before any
// sample). The slope is at least 0 (more prompt never prefills faster) and
// the prediction at least the intercept; with prompts all of one length
// it is their mean.
func (f *svcFit) at(x float64) time.Duration {
	if f.n == 0 {
		return 0
	}
	mx, my := f.x/f.n, f.y/f.n
	b := 0.0
	if v := f.xx/f.n - mx*mx; v > 1e-9*(1+mx*mx) {
		b = max((f.xy/f.n-mx*my)/v, 0)
	}
	a := my - b*mx
	y := max(a+b*x, 0)
	return time.Duration(y * float64(time.Second))
}

// service is the predicted time from admission to first token of it.
func (s *Sched) service(it *Item) time.Duration {
	if s.svcN == 0 {
		return 0
	}
	return s.svcFit.at(float64(s.compute(it)))
}

// slope is the fitted seconds per prompt token (0 while unknown).
func (f *svcFit) slope() float64 {
	if f.n == 0 {
		return 0
	}
	mx, my := f.x/f.n, f.y/f.n
	if v := f.xx/f.n - mx*mx; v > 1e-9*(1+mx*mx) {
		return max((f.xy/f.n-mx*my)/v, 0)
	}
	return 0
}
