package bridge

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
)

// An engine that restarts comes back with an empty cache and its seq
// counting from the start again. The bridge uses every signal the engine
// gives to notice, and to never vouch for a table of a process that is
// gone:
//
//   - the seq going back, or another topic (handle);
//   - the replay socket: the message the bridge saw last, asked for again,
//     must come back byte for byte (sameEngine, fillGap, resync);
//   - the process start time in the engine's /metrics
//     (process_start_time_seconds, which vLLM's Prometheus client exports)
//     changing (onProbe);
//   - the engine's HTTP /health failing while no event arrives: the
//     engine is down, and heartbeats say so (EngineDown) so that routers
//     stop counting its blocks at once.

// probeResult is one look at the engine's HTTP side.
type probeResult struct {
	up    bool    // /health answered, and not with a 5xx
	start float64 // process_start_time_seconds, 0 when not exported
}

// maxMetricsBody bounds how much of /metrics is read looking for the start
// time: vLLM's page is tens of KB; the process metrics come early.
const maxMetricsBody = 4 << 20

// probeOnce reads the engine's /health and, when it is up, the start time
// from /metrics.
func (in *instance) probeOnce(ctx context.Context) probeResult {
	timeout := max(2*in.b.cfg.EngineProbeInterval, time.Second)
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	get := func(path string) (*http.Response, error) {
		req, err := http.NewRequestWithContext(pctx, http.MethodGet, in.src.URL+path, nil)
		if err != nil {
			return nil, err
		}
		return in.b.http.Do(req)
	}
	resp, err := get("/health")
	if err != nil {
		return probeResult{}
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode >= 500 {
		// vLLM answers 503 once its engine is dead. Other answers
		// (even a 404 from a server without /health) show a live server.
		return probeResult{}
	}
	r := probeResult{up: true}
	resp, err = get("/metrics")
	if err != nil {
		return r
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 == 2 {
		r.start, _ = parseStartTime(io.LimitReader(resp.Body, maxMetricsBody))
	}
	return r
}

// parseStartTime finds process_start_time_seconds (no labels) in a
// Prometheus text exposition.
func parseStartTime(r io.Reader) (float64, bool) {
	const name = "process_start_time_seconds"
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for s.Scan() {
		line := s.Bytes()
		if !bytes.HasPrefix(line, []byte(name)) {
			continue
		}
		rest := line[len(name):]
		if len(rest) == 0 || (rest[0] != ' ' && rest[0] != '\t') {
			continue // another metric with this prefix, or labels
		}
		fields := bytes.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(string(fields[0]), 64)
		if err != nil || v <= 0 || v != v || v > 1e11 {
			continue
		}
		return v, true
	}
	return 0, false
}

// probe looks at the engine every EngineProbeInterval and hands the result
// to the process goroutine, which owns the table (latest result wins).
func (in *instance) probe(ctx context.Context) {
	tick := time.NewTicker(in.b.cfg.EngineProbeInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		r := in.probeOnce(ctx)
		select {
		case <-in.probes: // drop a result not yet taken
		default:
		}
		select {
		case in.probes <- r:
		case <-ctx.Done():
			return
		}
	}
}

// probeFailuresDown is how many probes in a row must fail, with no event
// in between, before the engine counts as down: one failed probe may be a
// blip (a slow answer under load); two, a probe interval apart, with the
// engine silent on ZMQ too, is an engine that is not serving.
const probeFailuresDown = 2

// onProbe acts on a probe result: marks the engine down or up, and clears
// the instance when the engine came back as another process.
func (in *instance) onProbe(ctx context.Context, r probeResult) error {
	if !r.up {
		in.probeFails++
		silent := time.Since(time.Unix(0, in.lastRecv.Load())) > in.b.cfg.EngineProbeInterval
		if in.probeFails >= probeFailuresDown && silent && !in.engineDown.Load() {
			in.engineDown.Store(true)
			in.b.m.engineDown.WithLabelValues(in.src.Instance).Set(1)
			in.log.Warn("engine down: HTTP health failing and no events; heartbeats say so", "url", in.src.URL)
			in.heartbeat()
		}
		return nil
	}
	in.probeFails = 0
	wasDown := in.engineDown.Load()
	in.mu.Lock()
	known := in.engineStart
	in.mu.Unlock()
	switch {
	case r.start != 0 && known != 0 && r.start != known:
		in.log.Info("engine restarted: process start time changed", "was", known, "now", r.start)
		in.setEngineStart(r.start)
		if err := in.restarted(ctx); err != nil {
			return err
		}
	case wasDown && (r.start == 0 || known == 0) && !in.sameEngine(ctx):
		in.log.Info("engine back after being down, and it cannot be proven the same process: clearing")
		in.setEngineStart(r.start)
		if err := in.restarted(ctx); err != nil {
			return err
		}
	default:
		in.setEngineStart(r.start)
	}
	if wasDown || (r.start != 0 && known != 0 && r.start != known) {
		// Back, or new: reconnect (or poll) now rather than at the end
		// of a backoff grown while the engine was away.
		in.sub.Kick()
		if in.src.pollNow != nil {
			in.src.pollNow()
		}
	}
	if wasDown {
		in.engineDown.Store(false)
		in.b.m.engineDown.WithLabelValues(in.src.Instance).Set(0)
		in.log.Info("engine up again")
		in.heartbeat()
	}
	return nil
}

// setEngineStart records the engine's start time once it is known.
func (in *instance) setEngineStart(start float64) {
	if start == 0 {
		return
	}
	in.mu.Lock()
	in.engineStart = start
	in.mu.Unlock()
}

// sameEngine reports whether the engine can be proven to be the process
// whose messages the table holds: its start time is the one known, or,
// asked for the last message the bridge published, its replay socket
// returns it byte for byte (a new process has another payload at that
// seq, or none; a loopback's replay returns it whatever the process).
func (in *instance) sameEngine(ctx context.Context) bool {
	if in.probing() {
		r := in.probeOnce(ctx)
		in.mu.Lock()
		known := in.engineStart
		in.mu.Unlock()
		if r.start != 0 && known != 0 {
			return r.start == known
		}
	}
	last, ok := in.tracker.Last()
	in.mu.Lock()
	hash := in.lastHash
	in.mu.Unlock()
	if !ok || hash == 0 || in.src.ReplayEndpoint == "" || in.src.LoopbackReplay {
		return false
	}
	same := false
	_ = enginezmq.Replay(ctx, in.replay, last, func(m enginezmq.Message) bool {
		same = m.Seq == last && xxhash.Sum64(m.Payload) == hash
		return false
	})
	return same
}

// restarted clears the instance for an engine that restarted, then
// publishes what the new process has published so far from its replay
// buffer; what cannot be replayed is asked for again when the next live
// message arrives (it finds the tracker empty). A loopback's buffer holds
// the dead process's messages and its seq goes on: only the clear, and
// the new process's messages follow on as the poller publishes them.
func (in *instance) restarted(ctx context.Context) error {
	in.replayed = replayWindow{}
	in.topic = "" // the new process's topic is learnt from its messages
	if in.src.LoopbackReplay {
		return in.clear(ctx, kvstream.SyntheticRestart)
	}
	in.tracker.Reset()
	if err := in.clear(ctx, kvstream.SyntheticRestart); err != nil {
		return err
	}
	if in.src.ReplayEndpoint == "" {
		return nil
	}
	msgs, err := in.replayAll(ctx, in.src.FirstSeq)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil || !contiguous(msgs, in.src.FirstSeq) {
		if err == nil {
			in.warnFirstSeq("restart", msgs[0].Seq)
		}
		in.log.Info("restarted engine's history not replayable yet; the next message asks again", "first_seq", in.src.FirstSeq, "err", err)
		return nil
	}
	if len(msgs) > 0 {
		in.countReplay(true)
		in.log.Info("restarted engine's history replayed", "messages", len(msgs))
	}
	return in.publishReplayed(ctx, msgs)
}

// fillStart publishes the engine's history before seq when the bridge
// hears it for the first time (it started before the engine, or the
// engine restarted): without it, what the engine stored before the bridge
// connected never reaches the index. When the replay cannot provide it,
// the instance stays as it is (empty: nothing else is known of this
// process) and the loss is counted.
func (in *instance) fillStart(ctx context.Context, seq uint64) error {
	first := in.src.FirstSeq
	if seq <= first {
		return nil
	}
	if in.src.ReplayEndpoint == "" {
		in.log.Warn("first message is not the engine's first and there is no replay: the blocks it stored before are unknown", "seq", seq, "first_seq", first)
		in.countReplay(false)
		return nil
	}
	msgs, err := enginezmq.ReplayRange(ctx, in.replay, first, seq)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil {
		var later *enginezmq.ReplayBeganLater
		if errors.As(err, &later) {
			in.warnFirstSeq("first message", later.Began)
		}
		in.countReplay(false)
		in.log.Warn("engine's history before its first message seen cannot be replayed: those blocks stay unknown", "seq", seq, "first_seq", first, "err", err)
		return nil
	}
	if len(msgs) == 0 {
		return nil
	}
	in.countReplay(true)
	in.log.Info("engine's history before its first message seen filled from replay", "seq", seq, "messages", len(msgs))
	return in.publishReplayed(ctx, msgs)
}

// warnFirstSeq warns when the engine's history, replayed from its first
// seq (Source.FirstSeq), began at the seq after it: the likeliest cause
// is an engine numbering from there, kvsim or llm-d-inference-sim (from
// 1) behind a bridge left at --first-seq 0, whose every history then
// reads as one that lost its first message, and the other lines name
// neither seq. Once per kind of replay (start-up, first message,
// restart, reconnect), not per message: a mistaken flag repeats it at
// every one (process goroutine).
func (in *instance) warnFirstSeq(kind string, began uint64) {
	first := in.src.FirstSeq
	if began != first+1 || in.firstSeqWarned[kind] {
		return
	}
	if in.firstSeqWarned == nil {
		in.firstSeqWarned = map[string]bool{}
	}
	in.firstSeqWarned[kind] = true
	engines := ""
	if began == 1 {
		engines = " (kvsim, llm-d-inference-sim)"
	}
	in.log.Warn(fmt.Sprintf("the engine's replay begins at seq %d, not --first-seq %d: if this engine numbers its messages from %d%s, run kvbridge with --first-seq %d",
		began, first, began, engines, began), "replay", kind, "began", began, "first_seq", first)
}

// replayAll asks the engine's replay socket for every message from seq
// from on, consecutively. Every caller needs exactly that (a history from
// from, or the message at from to compare and the ones after it), so the
// replay stops at the first reply that breaks it, returned last: one that
// does not begin at from (an engine numbering from past --first-seq, a
// buffer no longer reaching back) costs one reply, not the engine's whole
// buffer (up to 10,000 messages, ReplayBytes) at every retry.
func (in *instance) replayAll(ctx context.Context, from uint64) ([]enginezmq.Message, error) {
	var msgs []enginezmq.Message
	err := enginezmq.Replay(ctx, in.replay, from, func(m enginezmq.Message) bool {
		msgs = append(msgs, m)
		return m.Seq == from+uint64(len(msgs)-1)
	})
	return msgs, err
}

// countGap counts a gap in the engine's seq: in Stats and the metric.
func (in *instance) countGap() {
	in.gaps.Add(1)
	in.b.m.gaps.WithLabelValues(in.src.Instance).Inc()
}

// countReplay counts a replay that filled what it was asked for (ok) or
// could not: in Stats and the metric.
func (in *instance) countReplay(ok bool) {
	if ok {
		in.replays.Add(1)
		in.b.m.replays.WithLabelValues(in.src.Instance, "ok").Inc()
		return
	}
	in.replayFails.Add(1)
	in.b.m.replays.WithLabelValues(in.src.Instance, "failed").Inc()
}

// publishReplayed publishes replayed messages in order and remembers them
// so that live copies still in the buffer are dropped as duplicates.
func (in *instance) publishReplayed(ctx context.Context, msgs []enginezmq.Message) error {
	for _, m := range msgs {
		if err := in.publishEngine(ctx, m); err != nil {
			return err
		}
		in.tracker.Set(m.Seq)
		in.replayed.add(m)
	}
	return nil
}

// tailRecheck is how long after connecting the replay is asked again: a
// ZMQ subscription takes a round trip to reach the publisher, which drops
// what it sends before; half a second covers that on any network a
// sidecar uses (the engine is on the same host).
const tailRecheck = 500 * time.Millisecond

// maxTailRetry bounds catchTail's retries after a connection whose replay
// did not answer: asked again after 0.5, 1, 2, 4 and 8 s. An engine that
// sets its replay socket up only once its publisher is connected
// (llm-d-inference-sim does, within milliseconds) is covered through a
// slow start on a loaded node; past that, the engine's next message finds
// what the replay would have (a gap, or a restart), as before.
const maxTailRetry = 8 * time.Second

// kickTail asks the processing goroutine for catchTail (a signal merged
// with any pending one).
func (in *instance) kickTail() {
	select {
	case in.tail <- struct{}{}:
	default:
	}
}

// catchTail publishes what the engine published while the subscriber was
// not connected, after it (re)connects. A gap followed by a live message
// is found anyway; a tail with nothing after it (an engine idle since)
// would stay out of the index until the engine speaks again. A replay that
// fails here loses nothing (the next live message asks again); one that
// shows the buffer no longer reaching back clears the instance, as a gap.
func (in *instance) catchTail(ctx context.Context) error {
	if in.src.ReplayEndpoint == "" {
		return nil
	}
	if in.connected.Swap(false) {
		in.tailRetry = 0 // a new connection: its retries start over
	}
	// Asked from the last message handled, which must come back byte for
	// byte: the engine may have restarted and counted past it meanwhile.
	last, known := in.tracker.Last()
	msgs, from, restart, err := in.replayAfter(ctx)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if restart {
		in.log.Info("engine restarted while not connected to the bridge: clearing instance", "last_seq", last)
		return in.restarted(ctx)
	}
	if err != nil {
		// An engine may answer replays only a little after it connects:
		// asked again, doubling the wait, up to maxTailRetry; then the
		// next message asks.
		if in.tailRetry = max(2*in.tailRetry, tailRecheck); in.tailRetry <= maxTailRetry {
			time.AfterFunc(in.tailRetry, in.kickTail)
		}
		in.log.Debug("replay after connect failed", "from", from, "retry_in", in.tailRetry, "err", err)
		return nil
	}
	in.tailRetry = 0
	if len(msgs) == 0 {
		return nil
	}
	if !contiguous(msgs, from) {
		if !known {
			in.warnFirstSeq("reconnect", msgs[0].Seq)
			in.log.Debug("engine's history no longer replayable from its start; the next message asks again", "first_seq", from)
			return nil
		}
		in.countGap()
		in.countReplay(false)
		in.log.Warn("messages missed while disconnected: replay cannot fill them, clearing instance", "from", from)
		in.tracker.Reset()
		return in.clear(ctx, kvstream.SyntheticGap)
	}
	in.countReplay(true)
	in.log.Info("messages published while disconnected filled from replay", "from", from, "messages", len(msgs))
	return in.publishReplayed(ctx, msgs)
}

// replayAfter asks the engine's replay for what it published after the
// last message handled (from its start when none is). When that message's
// hash is known the replay starts at it, and it must come back byte for
// byte: restart reports that it did not (the engine is another process
// that counted past it), and no message is returned then. from is the seq
// the messages returned should start at: the engine's first
// (Source.FirstSeq) when no message is known.
func (in *instance) replayAfter(ctx context.Context) (msgs []enginezmq.Message, from uint64, restart bool, err error) {
	last, known := in.tracker.Last()
	in.mu.Lock()
	hash := in.lastHash
	in.mu.Unlock()
	check := known && hash != 0
	from = in.src.FirstSeq
	switch {
	case check:
		from = last
	case known:
		from = last + 1
	}
	msgs, err = in.replayAll(ctx, from)
	if err != nil || !check {
		return msgs, from, false, err
	}
	if len(msgs) == 0 || msgs[0].Seq != last || xxhash.Sum64(msgs[0].Payload) != hash {
		return nil, from, true, nil
	}
	return msgs[1:], last + 1, false, nil
}

// errNotSameEngine: the message before a gap, replayed, is not the one the
// bridge published: the engine behind the endpoint is another process.
var errNotSameEngine = fmt.Errorf("bridge: engine restarted behind a seq gap")
