package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/tick"
	"github.com/kvrouter/kvrouter/tiers"
)

// maxSSELine bounds one server-sent-event line: an eviction record is at
// most a few kilobytes (kvstream.MaxEvictionHashes hashes).
const maxSSELine = 1 << 20

// tailOpts are the options of 'tail evictions'.
type tailOpts struct {
	admin    adminOpts
	pool     string
	instance string
	tier     string
	natsURL  string
	creds    string
	natsCA   string
	count    int
	each     bool
	every    time.Duration
}

// recordSink prints eviction records — each as it arrives (--json,
// --each), or summed per instance, tier and reason every --every — and
// reports when --count records were taken. add is called by the reading
// goroutine and flush by the summary ticker, hence mu.
type recordSink struct {
	mu      sync.Mutex
	w       io.Writer
	stderr  io.Writer
	json    bool
	each    bool
	tier    string
	count   int
	printed int
	skipped int
	header  bool
	buf     bytes.Buffer
	sums    map[sumKey]*sumRow // summary mode: since the last flush
	order   []sumKey           // first-seen order of sums' keys
	now     func() time.Time
}

type sumKey struct{ instance, tier, reason string }

type sumRow struct {
	records int
	blocks  int
}

// errCountReached ends a tail after --count records.
var errCountReached = errors.New("count reached")

// add prints one record's JSON (filtered by tier), or counts it as skipped
// when it is not an eviction record.
func (s *recordSink) add(source string, data []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var rec kvstream.EvictionRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		s.skipped++
		fmt.Fprintf(s.stderr, "kvctl tail evictions: skipped a malformed record from %s: %v\n", source, err)
		return nil
	}
	if s.tier != "" && s.tier != kvstream.TierAll && !strings.EqualFold(rec.Tier, s.tier) && rec.Tier != kvstream.TierAll {
		return nil
	}
	switch {
	case !s.json && !s.each:
		k := sumKey{rec.Instance, rec.Tier, rec.Reason}
		r := s.sums[k]
		if r == nil {
			if s.sums == nil {
				s.sums = map[sumKey]*sumRow{}
			}
			r = &sumRow{}
			s.sums[k] = r
			s.order = append(s.order, k)
		}
		r.records++
		r.blocks += rec.Blocks
	case s.json:
		// One compact record per line, as received, for jq and friends.
		s.buf.Reset()
		if err := json.Compact(&s.buf, data); err != nil {
			s.skipped++
			return nil
		}
		s.buf.WriteByte('\n')
		if _, err := s.w.Write(s.buf.Bytes()); err != nil {
			return err
		}
	default:
		if !s.header {
			s.header = true
			fmt.Fprintf(s.w, "%-24s  %-20s  %-6s  %7s  %-8s  %s\n", "TIME", "INSTANCE", "TIER", "BLOCKS", "REASON", "HASHES")
		}
		ts := "-"
		if !rec.Time.IsZero() {
			ts = rec.Time.UTC().Format("2006-01-02T15:04:05.000Z")
		}
		if _, err := fmt.Fprintf(s.w, "%-24s  %-20s  %-6s  %7d  %-8s  %s\n", ts, rec.Instance, rec.Tier, rec.Blocks, rec.Reason, hashList(rec.Hashes, rec.Blocks)); err != nil {
			return err
		}
	}
	s.printed++
	if s.count > 0 && s.printed >= s.count {
		return errCountReached
	}
	return nil
}

// flush prints the summary rows gathered since the last flush, one per
// instance, tier and reason, in the order first seen.
func (s *recordSink) flush() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.order) == 0 {
		return nil
	}
	if !s.header {
		s.header = true
		fmt.Fprintf(s.w, "%-20s  %-20s  %-6s  %-8s  %7s  %8s\n", "TIME", "INSTANCE", "TIER", "REASON", "RECORDS", "BLOCKS")
	}
	ts := s.now().UTC().Format("2006-01-02T15:04:05Z")
	for _, k := range s.order {
		r := s.sums[k]
		if _, err := fmt.Fprintf(s.w, "%-20s  %-20s  %-6s  %-8s  %7d  %8d\n", ts, k.instance, k.tier, k.reason, r.records, r.blocks); err != nil {
			return err
		}
	}
	clear(s.sums)
	s.order = s.order[:0]
	return nil
}

// summarise flushes the sink every interval until ctx is done (summary
// mode only), and once more at the end.
func (s *recordSink) summarise(ctx context.Context, every time.Duration) (stop func()) {
	if s.json || s.each {
		return func() {}
	}
	done := make(chan struct{})
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer close(done)
		_ = tick.Every(ctx, every, func() { _ = s.flush() })
	}()
	return func() {
		cancel()
		<-done
		_ = s.flush()
	}
}

// hashList shows the first few hashes in hex, and how many more there were.
func hashList(hs []uint64, blocks int) string {
	const show = 3
	var b strings.Builder
	for i, h := range hs {
		if i == show {
			break
		}
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%016x", h)
	}
	if more := max(blocks, len(hs)) - min(len(hs), show); more > 0 && len(hs) > 0 {
		fmt.Fprintf(&b, " +%d", more)
	}
	if b.Len() == 0 {
		return "-"
	}
	return b.String()
}

func runTailEvictions(ctx context.Context, args []string, stdout io.Writer) error {
	return tailEvictions(ctx, args, stdout, os.Stderr)
}

// tailEvictions is 'tail evictions' with its diagnostics going to stderr.
func tailEvictions(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o tailOpts
	fs := adminFlagSet("tail evictions", stdout, &o.admin, `Usage: kvctl tail evictions --pool P [--instance I] [--tier T] [--nats URL] [--every D | --each | --json] [--count N]

Follows the KV blocks engines drop (engine evictions, whole-cache clears, and
clears the bridge made after a gap or a restart). By default it prints, every
--every, one line per instance, tier and reason with the records and blocks
seen; --each prints one line per record. Without --nats it reads the router's
server-sent events (GET /v1/kv/evictions on --router) and reconnects when the
router restarts; with --nats it subscribes to kv.evictions.<pool>.<instance>
itself, which needs no router. --json prints each record as one JSON line, as
published:
  {"pool":"llama","instance":"vllm-0","tier":"gpu","blocks":3,"hashes":[...],
   "time":"2026-11-29T10:00:00Z","reason":"evicted"}
Stop with Ctrl-C.

Examples:
  kvctl tail evictions --pool llama --tier gpu
  kvctl tail evictions --pool llama --nats nats://127.0.0.1:4222 --json | jq .blocks

Flags:`)
	fs.StringVar(&o.pool, "pool", "", "pool to follow (required)")
	fs.StringVar(&o.instance, "instance", "", "only this instance (default: every instance of the pool)")
	fs.StringVar(&o.tier, "tier", "", "only this tier: gpu, cpu, disk, shared (records clearing every tier, tier \"all\", always show)")
	fs.StringVar(&o.natsURL, "nats", "", "subscribe to NATS at this URL directly (e.g. nats://127.0.0.1:4222) instead of the router's SSE stream")
	fs.StringVar(&o.creds, "nats-creds", "", "NATS credentials file (with --nats)")
	fs.StringVar(&o.natsCA, "nats-ca", "", "CA file verifying the NATS server's TLS certificate (with --nats)")
	fs.IntVar(&o.count, "count", 0, "exit after this many records (0: follow until interrupted)")
	fs.BoolVar(&o.each, "each", false, "print one line per record instead of a summary every --every")
	fs.DurationVar(&o.every, "every", 2*time.Second, "summary period: records and blocks per instance, tier and reason")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := requirePool(fs, o.pool); err != nil {
		return err
	}
	if err := kvstream.ValidToken("pool", o.pool); err != nil {
		return fmt.Errorf("%w: --pool: %v", errUsage, err)
	}
	if o.instance != "" {
		if err := kvstream.ValidToken("instance", o.instance); err != nil {
			return fmt.Errorf("%w: --instance: %v", errUsage, err)
		}
	}
	if o.tier != "" && o.tier != kvstream.TierAll {
		t, ok := tiers.Parse(o.tier)
		if !ok {
			return fmt.Errorf("%w: --tier %q: want gpu, cpu, disk, shared or all", errUsage, o.tier)
		}
		o.tier = t.String() // the records' lower-case spelling
	}
	if o.count < 0 {
		return fmt.Errorf("%w: --count %d: must be 0 or more", errUsage, o.count)
	}
	if o.every < 100*time.Millisecond {
		return fmt.Errorf("%w: --every %v: must be at least 100ms", errUsage, o.every)
	}
	if o.natsURL == "" && (o.creds != "" || o.natsCA != "") {
		return fmt.Errorf("%w: --nats-creds and --nats-ca need --nats", errUsage)
	}
	sink := &recordSink{w: stdout, stderr: stderr, json: o.admin.json, each: o.each, tier: o.tier, count: o.count, now: time.Now}
	stop := sink.summarise(ctx, o.every)
	var err error
	if o.natsURL != "" {
		err = tailNATS(ctx, o, sink)
	} else {
		err = tailSSE(ctx, o, sink)
	}
	stop()
	if errors.Is(err, errCountReached) || (err == nil || errors.Is(err, context.Canceled)) && ctx.Err() != nil {
		return nil // interrupted, or --count reached: a normal end
	}
	return err
}

// tailNATS subscribes to the eviction subjects directly.
func tailNATS(ctx context.Context, o tailOpts, sink *recordSink) error {
	subj := kvstream.SubjectEvictions + "." + o.pool + ".*"
	if o.instance != "" {
		s, err := kvstream.EvictionsSubject(o.pool, o.instance)
		if err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		subj = s
	}
	// Unlike the bridge, kvctl fails fast when the first connection does
	// not come up (a typo in --nats should not look like a quiet stream),
	// then reconnects for as long as it runs.
	opts := []nats.Option{
		nats.Name("kvctl tail evictions"),
		nats.Timeout(o.admin.timeout),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(500 * time.Millisecond),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				fmt.Fprintf(sink.stderr, "kvctl tail evictions: nats disconnected: %v (reconnecting)\n", err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrSlowConsumer) {
				// kvctl fell behind (a paused terminal): records were dropped.
				fmt.Fprintf(sink.stderr, "kvctl tail evictions: fell behind, records dropped: %v\n", err)
				return
			}
			fmt.Fprintf(sink.stderr, "kvctl tail evictions: nats: %v\n", err)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			fmt.Fprintf(sink.stderr, "kvctl tail evictions: nats reconnected to %s; records published meanwhile are not replayed\n", nc.ConnectedUrl())
		}),
	}
	if o.creds != "" {
		opts = append(opts, nats.UserCredentials(o.creds))
	}
	if o.natsCA != "" {
		opts = append(opts, nats.RootCAs(o.natsCA))
	}
	nc, err := nats.Connect(o.natsURL, opts...)
	if err != nil {
		return fmt.Errorf("connect to nats %s: %w", o.natsURL, err)
	}
	defer nc.Close()
	ch := make(chan *nats.Msg, 1024)
	sub, err := nc.ChanSubscribe(subj, ch)
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", subj, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	// The subscription is registered once the server has seen it; flush so
	// that records published right after kvctl starts are not missed.
	if err := nc.FlushTimeout(o.admin.timeout); err != nil {
		return fmt.Errorf("subscribe %s: %w", subj, err)
	}
	fmt.Fprintf(sink.stderr, "kvctl tail evictions: following %s on %s\n", subj, nc.ConnectedUrl())
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case m := <-ch:
			if err := sink.add(m.Subject, m.Data); err != nil {
				return err
			}
		}
	}
}

// SSE reconnection backoff: from the first wait, doubled per failed try,
// up to the last (a router restart takes seconds; polling faster than once
// a few seconds would only add load to a router that is starting).
const (
	sseRetryFirst = 250 * time.Millisecond
	sseRetryMax   = 5 * time.Second
)

// tailSSE follows the router's GET /v1/kv/evictions stream. A first
// connection that fails is an error (a wrong --router should not look like
// a quiet pool); once following, a lost stream — the router restarting or
// the network — is reconnected until interrupted, and said on stderr
// (records published in between are not replayed).
func tailSSE(ctx context.Context, o tailOpts, sink *recordSink) error {
	c, err := o.admin.client()
	if err != nil {
		return err
	}
	q := url.Values{"pool": {o.pool}}
	if o.instance != "" {
		q.Set("instance", o.instance)
	}
	if o.tier != "" {
		q.Set("tier", o.tier)
	}
	path := "/v1/kv/evictions?" + q.Encode()
	followed := false
	wait := sseRetryFirst
	for {
		ok, err := tailSSEOnce(ctx, c, path, sink)
		followed = followed || ok
		var he *httpError
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, errCountReached):
			return err
		case !followed:
			return err
		case errors.As(err, &he) && he.Status >= 400 && he.Status < 500 && he.Status != http.StatusNotFound:
			return err // refused (auth, a bad filter): retrying will not help
		}
		if ok {
			wait = sseRetryFirst
		}
		fmt.Fprintf(sink.stderr, "kvctl tail evictions: %v; reconnecting in %v (records meanwhile are not replayed)\n", err, wait)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(wait*2, sseRetryMax)
	}
}

// tailSSEOnce follows the stream once; ok says it was followed (the
// router answered with an event stream), and err why it ended.
func tailSSEOnce(ctx context.Context, c *adminClient, path string, sink *recordSink) (ok bool, err error) {
	req, err := c.request(ctx, "GET", path, nil)
	if err != nil {
		return false, err
	}
	req.Header.Set("Accept", "text/event-stream")
	// No overall timeout: the stream lasts until interrupted. The
	// transport's dial and response-header timeouts bound connecting.
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		return false, c.connError("GET", req.URL.String(), err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return false, newHTTPError("GET", req.URL.String(), resp.StatusCode, b)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		return false, fmt.Errorf("GET %s: answer is %q, not an event stream", req.URL, ct)
	}
	// The router subscribes before it answers, so from here on no record
	// is missed.
	fmt.Fprintf(sink.stderr, "kvctl tail evictions: following %s\n", req.URL)
	err = readSSE(resp.Body, func(event string, data []byte) error {
		switch event {
		case "close":
			return io.EOF
		case "", "eviction", "message":
			return sink.add("the router's stream", data)
		}
		return nil // other event types: for newer routers, not kvctl
	})
	switch {
	case errors.Is(err, io.EOF):
		return true, errors.New("the router closed the stream (shutting down)")
	case errors.Is(err, errCountReached):
		return true, err
	case err != nil && ctx.Err() != nil:
		return true, ctx.Err()
	case err != nil:
		return true, fmt.Errorf("GET %s: %w", req.URL, err)
	}
	return true, fmt.Errorf("GET %s: stream ended without a close event", req.URL)
}

// readSSE parses a server-sent event stream (WHATWG HTML, "Server-sent
// events": fields "event" and "data", comment lines starting with ':', an
// event dispatched at a blank line, multi-line data joined by '\n') and
// calls fn per event with data. A non-nil error from fn stops it; the end
// of the stream returns nil.
func readSSE(r io.Reader, fn func(event string, data []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxSSELine)
	var event string
	var data []byte
	hasData := false
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) > 0 && line[len(line)-1] == '\r' {
			line = line[:len(line)-1]
		}
		if len(line) == 0 {
			if hasData || event != "" {
				if err := fn(event, data); err != nil {
					return err
				}
			}
			event, data, hasData = "", data[:0], false
			continue
		}
		if line[0] == ':' {
			continue // comment: the heartbeat
		}
		field, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimPrefix(value, []byte(" "))
		switch string(field) {
		case "event":
			event = string(value)
		case "data":
			if hasData {
				data = append(data, '\n')
			}
			data = append(data, value...)
			hasData = true
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read event stream: %w", err)
	}
	return nil
}
