package httpapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/openai"
)

// NewHTTPServer returns the http.Server for one of the router's listeners
// (data plane or admin) with the header limit and timeouts of cfg.Limits.
// No ReadTimeout or WriteTimeout: streams last minutes; the body deadline
// is set per request by the handler (see Server.Handler).
func NewHTTPServer(limits config.LimitsConfig, h http.Handler) *http.Server {
	l := limits.WithDefaults()
	return &http.Server{
		Handler: h,
		// Twice the limit: between the limit and this the handler answers
		// an OpenAI-shaped 431; beyond it net/http drops the request itself.
		MaxHeaderBytes:    2 * l.MaxHeaderBytes,
		ReadHeaderTimeout: l.ReadHeaderTimeout,
		IdleTimeout:       l.IdleTimeout,
	}
}

// headerBytes is the size of the request line and headers as sent (close
// enough: net/http has already parsed them).
func headerBytes(r *http.Request) int {
	n := len(r.Method) + len(r.RequestURI) + len(r.Proto) + 4
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4 // ": " and CRLF
		}
	}
	if r.Host != "" && r.Header.Get("Host") == "" {
		n += len("Host: \r\n") + len(r.Host) // net/http moves Host out of Header
	}
	return n
}

// limitInput enforces the per-request limits that come before any handler:
// the header size and the body read deadline.
func (s *Server) limitInput(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l := s.table.Load().Config().Limits // defaults applied when the table was built
		if n := headerBytes(r); n > l.MaxHeaderBytes {
			openai.WriteError(w, http.StatusRequestHeaderFieldsTooLarge, fmt.Sprintf("request headers of %d bytes exceed the limit of %d bytes", n, l.MaxHeaderBytes))
			s.m.requests.WithLabelValues("", "", "", "", "431").Inc()
			return
		}
		if r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 {
			// Unsupported writers (tests' recorders) have no deadline to set.
			if http.NewResponseController(w).SetReadDeadline(time.Now().Add(l.BodyReadTimeout)) == nil {
				r.Body = &deadlineBody{ReadCloser: r.Body}
			}
		}
		next.ServeHTTP(w, r)
	})
}

// deadlineBody turns a body read cut by the deadline into errBodyTimeout
// (answered 408). The deadline needs no clearing once the body is read:
// net/http clears it when the body reaches EOF, as it starts its background
// read of the connection (net/http connReader.startBackgroundRead), so a
// long stream is never cut (TestSlowClients holds that). On a timeout the
// expired deadline stays: before answering, net/http tries to drain the
// unread body, which must then fail fast rather than block.
type deadlineBody struct {
	io.ReadCloser
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF && isTimeout(err) {
		err = fmt.Errorf("%w: %w", errBodyTimeout, err)
	}
	return n, err
}

// errBodyTimeout marks a body read cut by limits.body_read_timeout.
var errBodyTimeout = errors.New("request body not received within limits.body_read_timeout")

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &t) && t.Timeout()
}
