package bridge

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
)

// TRTLLMPoller is kvbridge's input for TensorRT-LLM (--format
// trtllm-json). TensorRT-LLM serves its executor KV-cache events as JSON
// from trtllm-serve's POST /kv_cache_events (each call drains the engine's
// buffer; every attention-DP rank's events are gathered there). The poller
// reads them, converts them (events.TRTLLMConverter) and publishes one
// vLLM-shaped batch per rank on a loopback ZMQ publisher with a replay
// socket; the bridge subscribes to those like to any engine, so sequence
// tracking, replay, snapshots and heartbeats are the same code for every
// source (docs/engines.md).
type TRTLLMPoller struct {
	url      string
	interval time.Duration
	conv     events.TRTLLMConverter
	pubs     []*enginezmq.Publisher
	eps      []string // per rank: PUB endpoint, then replay endpoint
	http     *http.Client
	log      *slog.Logger
	wake     chan struct{} // cuts a wait short (pollNow)

	polls, failures, converted, lost, clears atomic.Uint64
}

// TRTLLMConfig configures a TRTLLMPoller.
type TRTLLMConfig struct {
	// EngineURL is trtllm-serve's base URL.
	EngineURL string
	// Ranks is the number of attention-DP ranks (default 1); events of
	// higher ranks are dropped and logged.
	Ranks int
	// Interval is the wait after an empty poll (default 100ms).
	Interval time.Duration
	// FullWindow: see events.TRTLLMConverter.
	FullWindow int
	Logger     *slog.Logger
}

// TRTLLMStats counts the poller's work. LostAnswers counts answers of
// drained events that could not be read (every rank cleared after each).
type TRTLLMStats struct {
	Polls, Failures, Events, Lost, LostAnswers uint64
}

// freeLoopback returns a tcp endpoint on a free loopback port.
func freeLoopback() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return "tcp://" + ln.Addr().String(), nil
}

// NewTRTLLMPoller binds the loopback publishers; Close releases them.
func NewTRTLLMPoller(ctx context.Context, cfg TRTLLMConfig) (*TRTLLMPoller, error) {
	if cfg.EngineURL == "" {
		return nil, errors.New("bridge: trtllm: no engine URL")
	}
	if cfg.Ranks == 0 {
		cfg.Ranks = 1
	}
	if cfg.Interval == 0 {
		cfg.Interval = 100 * time.Millisecond
	}
	if cfg.Ranks < 0 || cfg.Interval < 0 || cfg.FullWindow < 0 {
		return nil, errors.New("bridge: trtllm: negative ranks, interval or window")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &TRTLLMPoller{url: strings.TrimRight(cfg.EngineURL, "/") + "/kv_cache_events", interval: cfg.Interval,
		conv: events.TRTLLMConverter{FullWindow: cfg.FullWindow}, http: &http.Client{Timeout: 30 * time.Second}, log: cfg.Logger,
		wake: make(chan struct{}, 1)}
	for r := 0; r < cfg.Ranks; r++ {
		pub, err := freeLoopback()
		if err != nil {
			p.Close()
			return nil, err
		}
		replay, err := freeLoopback()
		if err != nil {
			p.Close()
			return nil, err
		}
		zp, err := enginezmq.NewPublisher(ctx, enginezmq.PublisherConfig{Endpoint: pub, ReplayEndpoint: replay, Topic: "trtllm"})
		if err != nil {
			p.Close()
			return nil, fmt.Errorf("bridge: trtllm: %w", err)
		}
		p.pubs = append(p.pubs, zp)
		p.eps = append(p.eps, pub, replay)
	}
	return p, nil
}

// Source returns the bridge source of rank r: the loopback endpoints, the
// instance name and the engine URL given. Its replay is the poller's, not
// the engine's (LoopbackReplay); an engine back from down is polled at
// once (pollNow).
func (p *TRTLLMPoller) Source(r int, instance, url string) Source {
	return Source{Instance: instance, Rank: r, Endpoint: p.eps[2*r], ReplayEndpoint: p.eps[2*r+1], URL: url,
		LoopbackReplay: true, pollNow: p.pollNow}
}

// pollNow ends the wait before the next poll, and the backoff with it.
func (p *TRTLLMPoller) pollNow() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Stats returns the poller's counters.
func (p *TRTLLMPoller) Stats() TRTLLMStats {
	return TRTLLMStats{Polls: p.polls.Load(), Failures: p.failures.Load(), Events: p.converted.Load(), Lost: p.lost.Load(),
		LostAnswers: p.clears.Load()}
}

// Close releases the publishers; call it after Run has returned.
func (p *TRTLLMPoller) Close() {
	for _, zp := range p.pubs {
		_ = zp.Close()
	}
}

// Run polls until ctx is done. After an empty answer it waits Interval; a
// failing engine is retried with backoff up to 5s, cut short when the
// bridge sees the engine up again (pollNow).
func (p *TRTLLMPoller) Run(ctx context.Context) {
	backoff := p.interval
	for ctx.Err() == nil {
		n, err := p.poll(ctx)
		wait := time.Duration(0)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			p.failures.Add(1)
			p.log.Warn("trtllm: poll /kv_cache_events failed", "err", err)
			wait = backoff
			backoff = min(2*backoff, 5*time.Second)
		case n == 0:
			wait, backoff = p.interval, p.interval
		default:
			backoff = p.interval
		}
		if wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			case <-p.wake:
				backoff = p.interval
			}
		}
	}
}

// lostAnswer clears every rank after an answer with status 200 that could
// not be read whole (see poll).
func (p *TRTLLMPoller) lostAnswer(err error) {
	p.conv.Forget()
	p.clears.Add(1)
	p.log.Warn("trtllm: an answer of drained events could not be read: clearing every rank", "err", err)
	ts := float64(time.Now().UnixNano()) / 1e9
	for r := range p.pubs {
		p.publish(r, ts, []events.Event{{Kind: events.AllBlocksCleared}})
	}
}

// publish sends rank r's events as one batch; an encode failure counts
// them lost.
func (p *TRTLLMPoller) publish(r int, ts float64, list []events.Event) {
	payload, err := events.Encode(nil, events.Batch{TS: ts, Events: list, DPRank: r, HasDPRank: true}, events.EncodingMap)
	if err != nil {
		p.lost.Add(uint64(len(list)))
		p.log.Error("trtllm: encode", "err", err)
		return
	}
	if _, err := p.pubs[r].Publish(payload); err != nil {
		p.log.Warn("trtllm: publish", "rank", r, "err", err)
	}
}

// poll reads one answer, converts it and publishes one batch per rank; it
// returns the number of engine events read.
func (p *TRTLLMPoller) poll(ctx context.Context) (int, error) {
	p.polls.Add(1)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(nil))
	if err != nil {
		return 0, err
	}
	resp, err := p.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer func() {
		// Read to its end (an error page: a bounded one) before the
		// close, so that the connection serves the next poll.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		_ = resp.Body.Close()
	}()
	// One answer is one drain of the engine's buffer (event_buffer_max_size
	// events); 64 MiB is far beyond that and bounds a broken server.
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %s", resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	var evs []events.TRTLLMEvent
	if err == nil {
		evs, err = events.DecodeTRTLLM(body)
	}
	if err != nil {
		// The engine drained its buffer into an answer that is lost (cut
		// off, or not readable): events nobody will see again, removals
		// among them. The next answer's event ids would show the gap, but
		// an engine gone quiet sends none, and until then every index
		// would hold blocks the engine may have dropped. Every rank is
		// cleared now, as after a gap. Not when the poller's context
		// ended the read (the bridge shutting down): the clears would
		// wipe the instance in every router for a stop of the bridge.
		if ctx.Err() == nil {
			p.lostAnswer(err)
		}
		return 0, err
	}
	if len(evs) == 0 {
		return 0, nil
	}
	p.converted.Add(uint64(len(evs)))
	perRank, st := p.conv.Convert(evs)
	if st.Gaps+st.Restarts+st.ExtraIDBlocks > 0 {
		p.log.Info("trtllm: converted with clears or drops", "gaps", st.Gaps, "restarts", st.Restarts, "extra_id_blocks", st.ExtraIDBlocks)
	}
	ts := float64(time.Now().UnixNano()) / 1e9
	for r, list := range perRank {
		if r < 0 || r >= len(p.pubs) {
			p.lost.Add(uint64(len(list)))
			p.log.Warn("trtllm: events of an attention-DP rank beyond the ranks configured dropped", "rank", r, "events", len(list))
			continue
		}
		p.publish(r, ts, list)
	}
	return len(evs), nil
}
