package des

import (
	"context"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/internal/cputime"
)

// Disagg serves requests in two stages, as kvrouter does for a pool with
// disaggregation on (docs/disaggregation.md): the router picks a prefill
// instance, which computes the prompt and one token; then, Handoff later,
// a decode instance, which receives the prompt's KV
// (EngineRequest.RemotePrefill) and generates. The client's first token is
// the decode instance's. A prefill the engine aborts or refuses is served
// aggregated on a decode instance, as the router falls back.
type Disagg struct {
	// Prefill is the number of prefill instances: the first Prefill of
	// Config.Instances (1 <= Prefill < Instances). The rest decode.
	Prefill int
	// Conditional serves a request aggregated (on a decode instance) when
	// the part of its prompt no decode instance holds is under
	// MinPrefillTokens (Uncached tells).
	Conditional      bool
	MinPrefillTokens int
	// Uncached reports that part for the decode set; known false: cannot
	// tell (the request is then disaggregated).
	Uncached func(ctx context.Context, req *RouteRequest, decode []string) (uncached int, known bool)
	// Handoff is the time between the prefill's answer and the decode
	// request reaching its instance: the router's second exchange
	// (default 1 ms).
	Handoff time.Duration
}

// RemoteReporter is implemented by engines that count the prompt tokens
// they received from remote prefills.
type RemoteReporter interface {
	RemoteTokens() uint64
}

// prefillTag marks engine request ids of prefill stages (request ids are
// workload indices, far below it).
const prefillTag = uint64(1) << 62

// handoff is a prefilled request whose decode stage is due.
type handoff struct {
	at     time.Duration
	req    int
	remote bool // the prefill succeeded: the decode receives its KV
}

// splitRoles divides the fleet into the prefill and decode sets.
func (r *run) splitRoles() error {
	d := r.cfg.Disagg
	if d == nil {
		return nil
	}
	if d.Prefill < 1 || d.Prefill >= len(r.live) {
		return fmt.Errorf("%w: disaggregation needs 1 <= prefill instances (%d) < instances (%d)", ErrConfig, d.Prefill, len(r.live))
	}
	if len(r.w.Fleet) > 0 {
		return fmt.Errorf("%w: disaggregation with scale events is not modelled", ErrConfig)
	}
	if d.Handoff == 0 {
		d.Handoff = time.Millisecond
	}
	r.prefillSet = append([]string(nil), r.live[:d.Prefill]...)
	r.decodeSet = append([]string(nil), r.live[d.Prefill:]...)
	r.prefilling = map[uint64]int{}
	return nil
}

// prefillStage starts request i's prefill; false when the request is to be
// served aggregated instead (the caller routes it over the decode set).
func (r *run) prefillStage(ctx context.Context, i int, rr *RouteRequest) bool {
	d := r.cfg.Disagg
	o := &r.res.Outcomes[i]
	if d.Conditional && d.Uncached != nil {
		if un, known := d.Uncached(ctx, rr, r.decodeSet); known && un < d.MinPrefillTokens {
			return false
		}
	}
	cpu0 := cputime.Thread()
	start := time.Now()
	pid := uint64(i) | prefillTag
	rr.EngineID, rr.NoWarm = pid, true
	dec, err := r.cfg.Router.Pick(ctx, rr, r.prefillSet)
	o.Decision += time.Since(start)
	if cpu0 >= 0 {
		o.DecisionCPU += max(cputime.Thread()-cpu0, 0)
	}
	in := r.byName[dec.Instance]
	if err != nil || in == nil || !in.live {
		return false
	}
	r.cfg.Router.Started(pid, in.name)
	prompt := append([]uint32(nil), rr.Tokens...)
	if err := in.engine.Submit(EngineRequest{ID: pid, Prompt: prompt, MaxTokens: 1, Adapter: rr.Adapter, CacheSalt: rr.CacheSalt}, r.now); err != nil {
		r.cfg.Router.Finished(pid, in.name, err)
		return false
	}
	o.PrefillInstance = in.name
	r.inflight[pid] = in
	r.prefilling[pid] = i
	r.schedule(in)
	return true
}

// prefillUpdate follows a prefill stage: its token tells the router the
// prefill is done; its end hands the request to a decode instance.
func (r *run) prefillUpdate(in *instance, u Update) {
	i := r.prefilling[u.ID]
	switch u.Kind {
	case FirstToken:
		r.cfg.Router.FirstToken(u.ID, in.name, u.CachedTokens, r.res.Outcomes[i].PromptTokens)
	case Finished, Aborted:
		var err error
		if u.Kind == Aborted {
			err = errAborted
			r.res.Outcomes[i].PrefillInstance = ""
		}
		delete(r.inflight, u.ID)
		delete(r.prefilling, u.ID)
		r.cfg.Router.Finished(u.ID, in.name, err)
		r.handoffs = append(r.handoffs, handoff{at: r.now + r.cfg.Disagg.Handoff, req: i, remote: err == nil})
	}
}

// decodeStage routes a prefilled request over the decode set and submits
// it with the prefill's KV.
func (r *run) decodeStage(ctx context.Context, h handoff) {
	req := &r.w.Requests[h.req]
	o := &r.res.Outcomes[h.req]
	salt := ""
	if r.cfg.SaltByTenant {
		salt = req.Tenant
	}
	r.tokBuf = req.AppendTokens(r.tokBuf[:0])
	rr := &RouteRequest{Request: req, Tokens: r.tokBuf, RoutingText: req.TextPrefix(r.cfg.PrefixLength), Now: r.now, CacheSalt: salt, EngineID: uint64(h.req),
		NoWarm: h.remote, RemotePrefill: h.remote}
	cpu0 := cputime.Thread()
	start := time.Now()
	d, err := r.cfg.Router.Pick(ctx, rr, r.decodeSet)
	o.Decision += time.Since(start)
	if cpu0 >= 0 {
		o.DecisionCPU += max(cputime.Thread()-cpu0, 0)
	}
	in := r.byName[d.Instance]
	if err == nil && (in == nil || !in.live) {
		err = fmt.Errorf("%w: router picked %q", errNotLive, d.Instance)
	}
	if err != nil {
		r.fail(o, "route", err)
		return
	}
	o.Instance, o.Reason, o.Overflow = d.Instance, d.Reason, d.Overflow
	r.cfg.Router.Started(uint64(h.req), in.name)
	prompt := append([]uint32(nil), r.tokBuf...)
	if err := in.engine.Submit(EngineRequest{ID: uint64(h.req), Prompt: prompt, MaxTokens: req.OutputTokens, Adapter: req.Adapter, CacheSalt: salt, RemotePrefill: h.remote}, r.now); err != nil {
		o.Err = "submit: " + err.Error()
		o.ErrKind = "submit: " + rootError(err).Error()
		o.Finish = r.now
		r.cfg.Router.Finished(uint64(h.req), in.name, err)
		r.done++
		if r.cfg.Progress != nil {
			r.cfg.Progress(r.done, len(r.w.Requests))
		}
		return
	}
	r.inflight[uint64(h.req)] = in
	r.schedule(in)
}
