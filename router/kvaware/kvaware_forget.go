package kvaware

import "github.com/prometheus/client_golang/prometheus"

// ForgetInstance implements router.Exact: inst left the pool, and what
// st keeps about it goes with it, so that a fleet whose instances come and
// go (heartbeat discovery, autoscaling) keeps state and series for the
// instances it has, not for every one it ever had: the pending-prefill
// counter (and with it the instance's predicted queue, its average W̄ for
// the placement term, its recent ends and listed pending requests, which
// replica sync publishes), its engine-load sample, the W̄ last published
// to the peers, and the series kvrouter_kv_pending_prefill_tokens and
// kvrouter_kv_load_scrapes_total for it. An instance that returns under
// the same id starts from nothing, as a new one.
//
// Requests still in flight there keep their counter (each observer holds
// its own): their release, first byte or end gives back to that counter,
// which no map holds any more, so nothing is made again for the instance
// and no counter a returning instance gets goes negative. The speculative
// overlay's holds on inst expire with their TTL, bounded as ever
// (spechold).
func (st *KVState) ForgetInstance(inst string) {
	st.pendMu.Lock()
	delete(st.pend, inst)
	st.pendMu.Unlock()
	st.loads.forget(inst)
	s := &st.peers.snap
	s.mu.Lock()
	delete(s.queues, inst)
	s.mu.Unlock()
	st.m.forget(st.pool, inst)
}

// forget deletes pool's per-instance series for inst.
func (m *KVMetrics) forget(pool, inst string) {
	m.pending.forget(pool, inst)
	m.scrapes.DeletePartialMatch(prometheus.Labels{"pool": pool, "instance": inst})
}
