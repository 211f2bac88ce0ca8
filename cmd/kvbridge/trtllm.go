package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
)

// Input formats (--format). vLLM and SGLang publish msgpack batches on
// ZMQ that the codec reads as they are; TensorRT-LLM's executor events come
// as JSON from trtllm-serve's POST /kv_cache_events, which kvbridge polls,
// converts (events.TRTLLMConverter) and feeds to the same pipeline through
// a loopback ZMQ publisher per attention-DP rank, so gaps, replay,
// snapshots and heartbeats work as for any engine (docs/engines.md).
const (
	formatVLLM   = "vllm"
	formatSGLang = "sglang"
	formatTRTLLM = "trtllm-json"
)

func validFormat(f string) error {
	switch f {
	case formatVLLM, formatSGLang, formatTRTLLM:
		return nil
	}
	return fmt.Errorf("--format %q: want vllm, sglang or trtllm-json", f)
}

// trtllmInput polls one trtllm-serve and republishes its events, converted,
// on loopback publishers, one per rank.
type trtllmInput struct {
	url      string // POST target
	interval time.Duration
	conv     events.TRTLLMConverter
	pubs     []*events.ZMQPublisher
	eps      []string // per rank: PUB endpoint, then replay endpoint
	http     *http.Client
	log      *slog.Logger
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

func newTRTLLMInput(ctx context.Context, o *options, log *slog.Logger) (*trtllmInput, error) {
	in := &trtllmInput{url: strings.TrimRight(o.engineURL, "/") + "/kv_cache_events", interval: o.pollInterval,
		conv: events.TRTLLMConverter{FullWindow: o.trtllmWindow}, http: &http.Client{Timeout: 30 * time.Second}, log: log}
	for r := 0; r < o.dpSize; r++ {
		pub, err := freeLoopback()
		if err != nil {
			in.close()
			return nil, err
		}
		replay, err := freeLoopback()
		if err != nil {
			in.close()
			return nil, err
		}
		p, err := events.NewZMQPublisher(ctx, events.ZMQPublisherConfig{Endpoint: pub, ReplayEndpoint: replay, Topic: "trtllm"})
		if err != nil {
			in.close()
			return nil, err
		}
		in.pubs = append(in.pubs, p)
		in.eps = append(in.eps, pub, replay)
	}
	return in, nil
}

// sources points the bridge at the loopback publishers; every rank's
// engine URL is the one server (TensorRT-LLM gathers every rank's events
// on rank 0's).
func (in *trtllmInput) sources(o *options) []bridge.Source {
	var out []bridge.Source
	for r := range in.pubs {
		s := bridge.Source{Instance: o.instance, Rank: r, Endpoint: in.eps[2*r], ReplayEndpoint: in.eps[2*r+1], URL: o.engineURL}
		if o.dpSize > 1 {
			s.Instance = fmt.Sprintf("%s-dp%d", o.instance, r)
		}
		out = append(out, s)
	}
	return out
}

func (in *trtllmInput) close() {
	for _, p := range in.pubs {
		_ = p.Close()
	}
}

// run polls until ctx is done. An empty answer waits interval before the
// next poll; a failing engine is retried with backoff up to 5s.
func (in *trtllmInput) run(ctx context.Context) {
	backoff := in.interval
	for ctx.Err() == nil {
		n, err := in.poll(ctx)
		wait := time.Duration(0)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			in.log.Warn("trtllm: poll /kv_cache_events failed", "err", err)
			wait = backoff
			backoff = min(2*backoff, 5*time.Second)
		case n == 0:
			wait, backoff = in.interval, in.interval
		default:
			backoff = in.interval
		}
		if wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
		}
	}
}

// poll reads one answer, converts it and publishes one batch per rank;
// it returns the number of engine events read.
func (in *trtllmInput) poll(ctx context.Context) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, in.url, bytes.NewReader(nil))
	if err != nil {
		return 0, err
	}
	resp, err := in.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	// An answer is one drain of the engine's event buffer; 64 MiB is far
	// beyond event_buffer_max_size's worth and bounds a broken server.
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %s", resp.Status)
	}
	evs, err := events.DecodeTRTLLM(body)
	if err != nil {
		return 0, err
	}
	if len(evs) == 0 {
		return 0, nil
	}
	perRank, st := in.conv.Convert(evs)
	if st.Gaps+st.Restarts+st.ExtraIDBlocks > 0 {
		in.log.Info("trtllm: converted with losses", "gaps", st.Gaps, "restarts", st.Restarts, "extra_id_blocks", st.ExtraIDBlocks)
	}
	ts := float64(time.Now().UnixNano()) / 1e9
	for r, list := range perRank {
		if r < 0 || r >= len(in.pubs) {
			in.log.Warn("trtllm: events of an attention-DP rank beyond --dp-size dropped", "rank", r, "events", len(list))
			continue
		}
		payload, err := events.Encode(nil, events.Batch{TS: ts, Events: list, DPRank: r, HasDPRank: true}, events.EncodingMap)
		if err != nil {
			in.log.Error("trtllm: encode", "err", err)
			continue
		}
		if _, err := in.pubs[r].Publish(payload); err != nil {
			in.log.Warn("trtllm: publish", "rank", r, "err", err)
		}
	}
	return len(evs), nil
}
