package kvstream

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/tiers"
)

// Eviction reasons (EvictionRecord.Reason).
const (
	// ReasonEvicted: the engine removed blocks from a tier (BlockRemoved).
	ReasonEvicted = "evicted"
	// ReasonCleared: the engine dropped its whole cache (AllBlocksCleared).
	ReasonCleared = "cleared"
	// ReasonGap, ReasonRestart, ReasonResync: the bridge cleared the
	// instance itself (see the Synthetic* constants).
	ReasonGap     = SyntheticGap
	ReasonRestart = SyntheticRestart
	ReasonResync  = SyntheticResync
)

// TierAll is EvictionRecord.Tier for a clear of every tier.
const TierAll = "all"

// MaxEvictionHashes bounds EvictionRecord.Hashes so a record stays small;
// a removal listing more goes as several records, each counting its own.
const MaxEvictionHashes = 64

// EvictionRecord is one JSON document on kv.evictions.<pool>.<instance>,
// e.g. {"pool":"llama","instance":"vllm-0","tier":"gpu","blocks":3,
// "hashes":[123,456,789],"time":"2026-11-29T10:00:00Z","reason":"evicted"}.
type EvictionRecord struct {
	Pool     string    `json:"pool"`
	Instance string    `json:"instance"`
	Tier     string    `json:"tier"`
	Blocks   int       `json:"blocks"`
	Hashes   []uint64  `json:"hashes,omitempty"`
	Time     time.Time `json:"time"`
	Reason   string    `json:"reason"`
}

// EvictionSSEConfig configures EvictionSSEHandler. Zero values mean defaults.
type EvictionSSEConfig struct {
	// Heartbeat is the period of ": ping" comment lines that keep proxies
	// from closing an idle stream (default 15s, below common 30–60s idle
	// timeouts).
	Heartbeat time.Duration
	// Buffer is the number of records queued per client before further
	// records are dropped for that client (default 256): a slow dashboard
	// must not slow the router.
	Buffer int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// WriteTimeout bounds each write to a client (default: Heartbeat, and
	// at least 5s). A client that has taken nothing for that long is not
	// reading (a stalled proxy, a suspended process): its stream ends.
	// Without a bound its write blocked for good (the router's HTTP
	// server has no write timeout: streams last), holding the handler,
	// its subscription and, at shutdown, the final close event.
	WriteTimeout time.Duration
	// KnownPool, when set, says whether a pool exists; a stream for a pool
	// it does not know is answered 404 instead of an empty stream that
	// would never carry a record (a typo would look like a quiet pool).
	KnownPool func(pool string) bool
}

// EvictionSSEHandler serves kv.evictions as server-sent events:
// GET ?pool=P[&instance=I][&tier=gpu|cpu|disk|shared|all]. pool is
// required. Each record is one "data: {json}" event; a ": ping" comment is
// sent every Heartbeat; the stream ends when the client goes away or ctx
// (the server's lifetime) is done.
func EvictionSSEHandler(ctx context.Context, nc *nats.Conn, cfg EvictionSSEConfig) http.Handler {
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = 15 * time.Second
	}
	if cfg.Buffer <= 0 {
		cfg.Buffer = 256
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = max(cfg.Heartbeat, 5*time.Second)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		pool, instance, tier := q.Get("pool"), q.Get("instance"), q.Get("tier")
		if err := ValidToken("pool", pool); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if cfg.KnownPool != nil && !cfg.KnownPool(pool) {
			http.Error(w, fmt.Sprintf("unknown pool %q", pool), http.StatusNotFound)
			return
		}
		subj := SubjectEvictions + "." + pool + ".*"
		if instance != "" {
			s, err := EvictionsSubject(pool, instance)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			subj = s
		}
		if tier != "" && tier != TierAll {
			if _, ok := tiers.Parse(tier); !ok {
				http.Error(w, fmt.Sprintf("unknown tier %q (want gpu, cpu, disk, shared or all)", tier), http.StatusBadRequest)
				return
			}
		}
		if _, ok := w.(http.Flusher); !ok {
			http.Error(w, "streaming unsupported", http.StatusInternalServerError)
			return
		}
		rc := http.NewResponseController(w)
		// send writes and flushes within WriteTimeout; false: the client is
		// gone or not reading.
		send := func(format string, args ...any) bool {
			_ = rc.SetWriteDeadline(time.Now().Add(cfg.WriteTimeout))
			if _, err := fmt.Fprintf(w, format, args...); err != nil {
				return false
			}
			return rc.Flush() == nil
		}
		ch := make(chan *nats.Msg, cfg.Buffer)
		sub, err := nc.ChanSubscribe(subj, ch)
		if err != nil {
			http.Error(w, "subscribe: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		// Drops beyond the per-client buffer are the slow client's loss.
		_ = sub.SetPendingLimits(cfg.Buffer, -1)
		defer func() { _ = sub.Unsubscribe() }()

		h := w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		h.Set("Connection", "keep-alive")
		h.Set("X-Accel-Buffering", "no")
		w.WriteHeader(http.StatusOK)
		if !send(": kv evictions for pool %s\n\n", pool) {
			return
		}

		var buf bytes.Buffer
		tick := time.NewTicker(cfg.Heartbeat)
		defer tick.Stop()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-ctx.Done():
				send("event: close\ndata: {}\n\n")
				return
			case <-tick.C:
				if !send(": ping\n\n") {
					return
				}
			case m := <-ch:
				if tier != "" && tier != TierAll {
					var rec EvictionRecord
					if err := json.Unmarshal(m.Data, &rec); err != nil {
						cfg.Logger.Debug("eviction sse: skipped malformed record", "subject", m.Subject, "err", err)
						continue
					}
					if rec.Tier != tier && rec.Tier != TierAll {
						continue
					}
				}
				// Compacted, because a newline inside the JSON would end the
				// SSE data line early.
				buf.Reset()
				if err := json.Compact(&buf, m.Data); err != nil {
					continue
				}
				if !send("event: eviction\ndata: %s\n\n", buf.Bytes()) {
					return
				}
			}
		}
	})
}

// AppendJSON appends the record's JSON to dst: the bytes json.Marshal
// writes (TestEvictionRecordAppendJSON), without its reflection and
// allocations, which were ~4 % of a loaded bridge's CPU (docs/BENCHMARKS.md
// §3, "Session 13"). Strings that need escaping, and times json.Marshal
// refuses, take json.Marshal itself.
func (r EvictionRecord) AppendJSON(dst []byte) ([]byte, error) {
	if !plainJSON(r.Pool) || !plainJSON(r.Instance) || !plainJSON(r.Tier) || !plainJSON(r.Reason) ||
		!plainTime(r.Time) {
		b, err := json.Marshal(r)
		return append(dst, b...), err
	}
	dst = append(dst, `{"pool":"`...)
	dst = append(dst, r.Pool...)
	dst = append(dst, `","instance":"`...)
	dst = append(dst, r.Instance...)
	dst = append(dst, `","tier":"`...)
	dst = append(dst, r.Tier...)
	dst = append(dst, `","blocks":`...)
	dst = strconv.AppendInt(dst, int64(r.Blocks), 10)
	if len(r.Hashes) > 0 {
		dst = append(dst, `,"hashes":[`...)
		for i, h := range r.Hashes {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = strconv.AppendUint(dst, h, 10)
		}
		dst = append(dst, ']')
	}
	dst = append(dst, `,"time":"`...)
	dst = r.Time.AppendFormat(dst, time.RFC3339Nano)
	dst = append(dst, `","reason":"`...)
	dst = append(dst, r.Reason...)
	return append(dst, `"}`...), nil
}

// plainJSON reports whether json.Marshal writes s as itself in quotes:
// printable ASCII without the characters it escapes.
func plainJSON(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// plainTime reports whether json.Marshal accepts t: a four-digit year and
// a zone offset of whole minutes under a day.
func plainTime(t time.Time) bool {
	_, off := t.Zone()
	return t.Year() >= 0 && t.Year() <= 9999 && off%60 == 0 && off > -24*3600 && off < 24*3600
}
