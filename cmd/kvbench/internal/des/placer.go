package des

// Placer is an Admission whose budgets are per instance (router/flowcontrol
// with instance budgets): it admits a request only while some instance has
// room, and the driver routes the request among those instances.
type Placer interface {
	// Fleet: the live instances changed (called at the start and after
	// every scale event).
	Fleet(live []string)
	// Candidates appends to dst those of cands that have room for request
	// id; none means any of cands.
	Candidates(id uint64, cands, dst []string) []string
	// Placed: request id was routed to instance.
	Placed(id uint64, instance string)
	// KeptFree appends to dst the instances kept free of long prompts
	// for request id (RouteRequest.KeptFree).
	KeptFree(id uint64, dst []string) []string
}

// fleetChanged tells a Placer the live instances.
func (r *run) fleetChanged() {
	if p, ok := r.cfg.Admission.(Placer); ok {
		p.Fleet(r.live)
	}
}

// placeable narrows cands to the instances a Placer has room in.
func (r *run) placeable(id uint64, cands []string) []string {
	p, ok := r.cfg.Admission.(Placer)
	if !ok {
		return cands
	}
	r.roomBuf = p.Candidates(id, cands, r.roomBuf[:0])
	if len(r.roomBuf) == 0 {
		return cands
	}
	return r.roomBuf
}

// keptFree is the instances a Placer keeps free of long prompts for
// request id (nil without a Placer).
func (r *run) keptFree(id uint64) []string {
	p, ok := r.cfg.Admission.(Placer)
	if !ok {
		return nil
	}
	r.keptBuf = p.KeptFree(id, r.keptBuf[:0])
	return r.keptBuf
}

// placed tells a Placer where request id went.
func (r *run) placed(id uint64, instance string) {
	if p, ok := r.cfg.Admission.(Placer); ok {
		p.Placed(id, instance)
	}
}
