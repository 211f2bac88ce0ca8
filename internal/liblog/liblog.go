// Package liblog routes what the NATS and Redis client libraries report
// into the process's structured log: each line (or asynchronous error)
// is counted in a metric, and logged rate-limited, so that a fault that
// makes a library repeat itself (a Redis outage's dial failures, a burst
// of NATS slow-consumer errors) costs a few structured lines per interval
// instead of thousands of unstructured ones on stderr.
package liblog

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/ratelog"
)

// The rate: per library and kind, at most Burst lines per Window; the
// rest are counted and reported with the next line let through. Five
// lines every ten seconds show an operator what is happening and how
// often, and cost nothing however hard the library repeats itself.
const (
	Window = 10 * time.Second
	Burst  = 5
)

// Logs routes library output into log. Build it with New; safe for
// concurrent use.
type Logs struct {
	log   *slog.Logger
	lim   *ratelog.Limiter
	lines *prometheus.CounterVec
}

// New returns Logs writing to log and counting into the counter metric
// (<binary>_library_log_lines_total){library, kind} on reg (nil: not
// registered).
func New(reg prometheus.Registerer, log *slog.Logger, metric string) (*Logs, error) {
	l := &Logs{log: log, lim: ratelog.New(Window, Burst),
		lines: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: metric,
			Help: "Lines and asynchronous errors reported by client libraries (go-redis, nats.go), by library and kind; logged rate-limited.",
		}, []string{"library", "kind"})}
	if reg != nil {
		if err := reg.Register(l.lines); err != nil {
			return nil, fmt.Errorf("liblog: %w", err)
		}
	}
	return l, nil
}

// emit counts a line and logs it unless its kind is over the rate.
func (l *Logs) emit(library, kind, msg string, attrs ...any) {
	l.lines.WithLabelValues(library, kind).Inc()
	ok, suppressed := l.lim.Allow(library + "/" + kind)
	if !ok {
		return
	}
	attrs = append(attrs, "library", library, "kind", kind)
	if suppressed > 0 {
		attrs = append(attrs, "suppressed", suppressed)
	}
	l.log.Warn(msg, attrs...)
}

// Redis returns the logger to give redis.SetLogger (go-redis's
// internal.Logging: Printf with a context).
func (l *Logs) Redis() *RedisLogger { return &RedisLogger{l: l} }

// RedisLogger adapts Logs to go-redis's logger interface.
type RedisLogger struct{ l *Logs }

// Printf implements go-redis's internal.Logging.
func (r *RedisLogger) Printf(_ context.Context, format string, v ...any) {
	// The kind is the message's first words, before any formatted value:
	// stable per call site, so each site has its own rate.
	kind := format
	if i := strings.IndexByte(kind, '%'); i >= 0 {
		kind = kind[:i]
	}
	kind = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(kind), ":"))
	if kind == "" {
		kind = "log"
	}
	r.l.emit("go-redis", kind, "redis client: "+strings.TrimSpace(fmt.Sprintf(format, v...)))
}

// NATSErrorHandler is the nats.ErrorHandler for connections: slow
// consumers (messages dropped for a subscription that could not keep up)
// and other asynchronous errors, with the subscription's subject.
func (l *Logs) NATSErrorHandler() nats.ErrHandler {
	return func(_ *nats.Conn, sub *nats.Subscription, err error) {
		kind := "error"
		if errors.Is(err, nats.ErrSlowConsumer) {
			kind = "slow_consumer"
		}
		subject := ""
		if sub != nil {
			subject = sub.Subject
		}
		l.emit("nats.go", kind, "nats client: asynchronous error", "subject", subject, "err", err)
	}
}
