package kvstream

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/internal/liblog"
)

// NATSConfig is how kvbridge and kvrouter connect to NATS. Zero values mean
// defaults; URL is required.
type NATSConfig struct {
	// URL is one or more server URLs, comma-separated.
	URL string
	// CredsFile is a NATS credentials (JWT + nkey) file.
	CredsFile string
	// TLSCA verifies the server; TLSCert and TLSKey are the client's
	// certificate for mutual TLS (both or neither).
	TLSCA, TLSCert, TLSKey string
	// Name identifies the client in the server's monitoring.
	Name string
	// ReconnectWait defaults to 250ms. Reconnects never stop: the bridge
	// and the consumer outlive any NATS outage and catch up after it.
	ReconnectWait time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// ErrorHandler receives the connection's asynchronous errors (slow
	// consumers, permission violations); nil = logged through Logger,
	// rate-limited (liblog), never nats.go's default of a raw line on
	// stderr per error.
	ErrorHandler nats.ErrHandler
}

// Connect dials NATS with reconnection forever (also when the first
// attempt fails: the connection comes up when the server does), logging
// disconnects and reconnects.
func (c NATSConfig) Connect() (*nats.Conn, error) {
	if c.URL == "" {
		return nil, errors.New("kvstream: nats url is empty")
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		return nil, errors.New("kvstream: nats tls cert and key must be given together")
	}
	if c.ReconnectWait <= 0 {
		c.ReconnectWait = 250 * time.Millisecond
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	onErr := c.ErrorHandler
	if onErr == nil {
		libs, _ := liblog.New(nil, log, "library_log_lines_total") // unregistered: cannot fail
		onErr = libs.NATSErrorHandler()
	}
	opts := []nats.Option{
		nats.Name(c.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(c.ReconnectWait),
		nats.RetryOnFailedConnect(true),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats reconnected", "url", nc.ConnectedUrl()) }),
		nats.ErrorHandler(onErr),
	}
	if c.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(c.CredsFile))
	}
	if c.TLSCA != "" {
		opts = append(opts, nats.RootCAs(c.TLSCA))
	}
	if c.TLSCert != "" {
		opts = append(opts, nats.ClientCert(c.TLSCert, c.TLSKey))
	}
	nc, err := nats.Connect(c.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("kvstream: nats %s: %w", c.URL, err)
	}
	return nc, nil
}
