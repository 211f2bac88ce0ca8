package flowcontrol

import (
	"math"
	"slices"
	"time"
)

// svcFit is a least-squares fit of the time from admission to first
// token, over about the last estimatorWindow first tokens (exponentially
// weighted sums), on two amounts of prefill work: the request's own (its
// prompt tokens its instance does not hold) and the work ahead of it there
// when it was bound (the uncached tokens of the requests bound there
// before it and not yet at their first token; vLLM prefills first come,
// first served). y = a + b·own + c·ahead: b is the engine's time per token
// of a prompt's own prefill (a 10,000-token prompt takes several of a
// 1,000-token one's steps), c what a token still ahead adds (less than b
// when part of it is already prefilled), a what every request waits
// besides (the step in progress, its own step's decode batch). With a
// line through the request's own length alone, the wait ahead of the
// requests of each length was averaged into that length's prediction; a
// class then shed on arrival for that average (it passed the class's
// objective) added no sample to lower it, and the line kept the value for
// good — new samples at other lengths, decayed alike, cannot move it
// there. kv_aware at 8 instances, 4× load, shed 97 % of requests for good
// after the burst's first half second (docs/BENCHMARKS.md §12, "The
// service line learns the work ahead"). Now the router predicts with the
// work ahead on an instance where it knows it (pastDeadline) and, at
// arrival and expiry, before an instance is chosen, with nothing ahead: a
// request is shed or expires only when no instance could meet its
// deadline.
type svcFit struct {
	n, x, z, y, xx, xz, zz, xy, zy, yy float64
	// seen counts the samples up to seedN, the first of which seed holds.
	seen int
	seed [seedN]svcSample
}

type svcSample struct{ own, ahead, y float64 }

// Bounding one slow first token's influence. In sums of squares one
// sample of 20 s among 50 ms ones sets the spread at 20 s × √(its share
// of the weight): as the fit's first sample, it kept the room test and
// arrival shedding from admitting about half of the requests with a 2 s
// objective for ~15 s (sheds bring no samples to dilute it). So:
//
//   - The fit sheds nothing (mature) until it has seedN first tokens, and
//     then drops from those the ones slower than their fit by more than
//     outlierZ robust standard deviations (1.4826 × the median absolute
//     residual, which one slow sample cannot move): the modified z-score
//     of Iglewicz and Hoaglin, "How to Detect and Handle Outliers" (ASQC,
//     1993), whose 3.5 they recommend. seedN = 8: the median of 8 ignores
//     up to 3 slow first tokens; more would leave deadline shedding off
//     longer at start-up (requests are then admitted and may miss, as
//     without objectives), and 8 first tokens are a fraction of one
//     turnover of a pool's slots.
//   - After that, a sample is winsorized at the fit's prediction plus
//     winsorZ spreads (at least double the prediction, so that a fit with
//     no spread can still learn a slowdown): under the normal residuals
//     the margin assumes (tailZ), a sample lies beyond 4σ 3 times in
//     100,000, so a steady engine's fit is unchanged, while a real
//     slowdown, clipped sample after sample, widens the spread ~11 % a
//     sample (each adds 16σ²/estimatorWindow to σ²) and is followed
//     within a few dozen first tokens; one outlier moves it by one
//     clipped sample.
const (
	seedN    = 8
	outlierZ = 3.5
	winsorZ  = 4
)

// mature reports whether the fit has enough samples to shed on.
func (f *svcFit) mature() bool { return f.seen >= seedN }

func (f *svcFit) add(own, ahead, y float64) {
	if f.mature() {
		p := f.at(own, ahead).Seconds()
		y = min(y, p+max(winsorZ*f.spread(), p))
		f.sum(own, ahead, y)
		return
	}
	f.sum(own, ahead, y)
	f.seed[f.seen] = svcSample{own, ahead, y}
	if f.seen++; f.seen == seedN {
		f.reseed()
	}
}

// reseed rebuilds the sums from the seed samples less the outliers: those
// whose residual about the seed's fit exceeds outlierZ robust standard
// deviations (above).
func (f *svcFit) reseed() {
	var res [seedN]float64
	for i, x := range f.seed {
		res[i] = x.y - f.at(x.own, x.ahead).Seconds()
	}
	abs := res
	for i := range abs {
		abs[i] = math.Abs(abs[i])
	}
	slices.Sort(abs[:])
	sigma := 1.4826 * (abs[seedN/2-1] + abs[seedN/2]) / 2
	*f = svcFit{seen: f.seen, seed: f.seed}
	for i, x := range f.seed {
		if res[i] <= outlierZ*sigma {
			f.sum(x.own, x.ahead, x.y)
		}
	}
}

func (f *svcFit) sum(own, ahead, y float64) {
	const keep = 1 - 1.0/estimatorWindow
	f.n = f.n*keep + 1
	f.x = f.x*keep + own
	f.z = f.z*keep + ahead
	f.y = f.y*keep + y
	f.xx = f.xx*keep + own*own
	f.xz = f.xz*keep + own*ahead
	f.zz = f.zz*keep + ahead*ahead
	f.xy = f.xy*keep + own*y
	f.zy = f.zy*keep + ahead*y
	f.yy = f.yy*keep + y*y
}

// coef is the fit: a in seconds, b and c in seconds per token, each at
// least 0. A coefficient the samples cannot tell (nothing was ever ahead,
// or every prompt was as long) is taken equal to the other: the engine
// prefills a token ahead as it does one of its own.
func (f *svcFit) coef() (a, b, c float64) {
	if f.n == 0 {
		return 0, 0, 0
	}
	mx, mz, my := f.x/f.n, f.z/f.n, f.y/f.n
	vxx, vzz, vxz := f.xx/f.n-mx*mx, f.zz/f.n-mz*mz, f.xz/f.n-mx*mz
	cxy, czy := f.xy/f.n-mx*my, f.zy/f.n-mz*my
	okx, okz := vxx > 1e-9*(1+mx*mx), vzz > 1e-9*(1+mz*mz)
	one := func(v, cv float64) float64 { return max(cv/v, 0) }
	switch {
	case okx && okz:
		if det := vxx*vzz - vxz*vxz; det > 1e-9*vxx*vzz {
			b = (vzz*cxy - vxz*czy) / det
			c = (vxx*czy - vxz*cxy) / det
		}
		switch {
		case b < 0 && c < 0, b == 0 && c == 0:
			b, c = 0, 0
			b = one(vxx, cxy)
			if b == 0 {
				c = one(vzz, czy)
			}
		case b < 0:
			b, c = 0, one(vzz, czy)
		case c < 0:
			b, c = one(vxx, cxy), 0
		}
		if c > b {
			// A token ahead costs at most what one of the request's own
			// does (part of it may be prefilled already, none of it
			// twice). Fitted above that, c read noise — one slow first
			// token behind work, among samples that had nothing ahead,
			// fixed c at its whole excess, and an instance with anything
			// ahead had no room for a request with a deadline until that
			// sample decayed, while only idle instances' samples came.
			// The least-squares fit held to c ≤ b is, when the bound
			// binds, one coefficient on the sum of the two.
			// (Where own + ahead never varied, that sum says nothing: b
			// stays as fitted.)
			if vs := vxx + vzz + 2*vxz; vs > 1e-9*(1+(mx+mz)*(mx+mz)) {
				b = max((cxy+czy)/vs, 0)
			}
			c = b
		}
	case okx:
		b = one(vxx, cxy)
		c = b
	case okz:
		c = one(vzz, czy)
		b = c
	}
	return my - b*mx - c*mz, b, c
}

// at is the predicted service time for own tokens of work with ahead
// tokens of work before it (0 before any sample), at least 0.
func (f *svcFit) at(own, ahead float64) time.Duration {
	a, b, c := f.coef()
	return time.Duration(max(a+b*own+c*ahead, 0) * float64(time.Second))
}

// service is the predicted time from admission to first token of it on an
// instance with nothing ahead of it, the one holding most of its prompt:
// the least any instance can give it — where the room test keeps a
// request with a deadline off an instance with too much ahead
// (InstancePrefill, pastDeadline). Without it nothing does, and a
// request goes wherever a slot is free with the usual work ahead: the
// prediction counts the fit's mean work ahead (the line through the
// request's own length alone averaged it in the same way).
func (s *Sched) service(it *Item) time.Duration {
	if !s.svcFit.mature() {
		return 0 // too few first tokens to shed on (svcFit)
	}
	return s.serviceFit(it)
}

// serviceFit is service from the fit's first sample on.
func (s *Sched) serviceFit(it *Item) time.Duration {
	if s.svcN == 0 {
		return 0
	}
	ahead := 0.0
	if s.cfg.InstancePrefill <= 0 && s.svcFit.n > 0 {
		ahead = s.svcFit.z / s.svcFit.n
	}
	return s.svcFit.at(float64(uncached(it)), ahead)
}

// slope is the fitted seconds per token of a request's own work (0 while
// unknown).
func (f *svcFit) slope() float64 {
	_, b, _ := f.coef()
	return b
}

// spread is the standard deviation, in seconds, of the samples about the
// fit (the exponentially weighted mean of the squared residuals, from the
// same sums: for any b and c the residuals' mean is 0, a being taken so).
func (f *svcFit) spread() float64 {
	if f.n == 0 {
		return 0
	}
	_, b, c := f.coef()
	mx, mz, my := f.x/f.n, f.z/f.n, f.y/f.n
	vxx, vzz, vxz := f.xx/f.n-mx*mx, f.zz/f.n-mz*mz, f.xz/f.n-mx*mz
	cxy, czy, vyy := f.xy/f.n-mx*my, f.zy/f.n-mz*my, f.yy/f.n-my*my
	return math.Sqrt(max(vyy-2*b*cxy-2*c*czy+b*b*vxx+c*c*vzz+2*b*c*vxz, 0))
}

// tailZ is how many spreads above the fit's mean a first token comes at
// most missShare of the time, the residuals taken as normal: the quantile
// 1 − missShare of the standard normal (1.28 for one in ten).
var tailZ = math.Sqrt2 * math.Erfinv(1-2*missShare)

// late is the time from admission to first token that at most missShare
// of requests with own tokens of work and ahead tokens before them
// exceed (pastDeadline).
func (f *svcFit) late(own, ahead float64) time.Duration {
	return f.at(own, ahead) + time.Duration(tailZ*f.spread()*float64(time.Second))
}
