package flowcontrol

import "time"

// svcFit is a least-squares line through (prefill work, admission to
// first token) over about the last estimatorWindow first tokens
// (exponentially weighted sums). A request's work is the prompt tokens its
// engine prefills before its first token: the uncached tokens of the
// requests bound to its instance before it and not yet at their first
// token, then its own uncached tokens (vLLM schedules prefill first come,
// first served). The slope is the engine's time per prefilled token, the
// intercept what every request waits besides prefill (the step in
// progress, its own step's decode batch).
//
// The work ahead is in x, not left in the intercept: a line through a
// request's own prompt length alone averages into each length the wait
// ahead of the requests of that length that were admitted, and a class
// that was then shed on arrival for that average (it passed the class's
// objective) added no sample to lower it: the line kept its transient
// value for good, since new samples at other lengths, decayed alike,
// cannot move it there. kv_aware at 8 instances, 4× load, shed 97 % of
// requests for good after the burst's first half second (docs/BENCHMARKS.md
// §12, "The service line learns the work ahead"). A prediction from the
// work ahead is one the router checks against the instances themselves
// (pastDeadline); at arrival and expiry, where the instance is not chosen
// yet, a request is predicted with nothing ahead: shed or expired only
// when no instance could meet its deadline. And in uncached tokens, not
// whole prompts: a cached 1,000-token prompt is ~50 tokens of prefill, and
// whole prompts put kv_aware's light requests far off the line the long
// prompts draw.
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

// at is the predicted service time for x tokens of work (0 before any
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

// service is the predicted time from admission to first token of it on an
// instance with nothing ahead of it, the one holding most of its prompt:
// the least any instance can give it.
func (s *Sched) service(it *Item) time.Duration {
	if s.svcN == 0 {
		return 0
	}
	return s.svcFit.at(float64(uncached(it)))
}

// slope is the fitted seconds per token of work (0 while unknown).
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
