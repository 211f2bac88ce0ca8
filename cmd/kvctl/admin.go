package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
	"github.com/kvrouter/kvrouter/internal/pemfile"
	"github.com/kvrouter/kvrouter/router/admin/adminapi"
)

// Environment variables that default the common admin flags, so that an
// operator's shell (or a CI job) names the router and its token once.
const (
	envAdminURL   = "KVROUTER_ADMIN_URL"
	envAdminToken = "KVROUTER_ADMIN_TOKEN"
	envAdminCA    = "KVROUTER_ADMIN_CA"
	envAdminCert  = "KVROUTER_ADMIN_CERT"
	envAdminKey   = "KVROUTER_ADMIN_KEY"
)

// defaultAdminURL is kvrouter's admin listener on the same machine
// (docs/kvrouter.md: admin_listen ":8081").
const defaultAdminURL = "http://127.0.0.1:8081"

// maxAdminResponse bounds what kvctl reads from one admin answer: the
// largest (instances of a big pool) are tens of kilobytes.
const maxAdminResponse = 32 << 20

// adminOpts are the flags every command that talks to the router shares.
type adminOpts struct {
	router  string
	token   string
	timeout time.Duration
	json    bool
	// ca, cert, key: PEM files for an https:// router: the CA its server
	// certificate is checked against (default: the system's), and the
	// client certificate and key a listener with client_ca_file (mutual
	// TLS) asks for.
	ca, cert, key string
}

// addAdminFlags registers --router, --token, --timeout and --json on fs.
func addAdminFlags(fs *flag.FlagSet, o *adminOpts) {
	def := os.Getenv(envAdminURL)
	if def == "" {
		def = defaultAdminURL
	}
	fs.StringVar(&o.router, "router", def, "router admin API base URL (env "+envAdminURL+")")
	fs.StringVar(&o.token, "token", os.Getenv(envAdminToken), "admin bearer token (env "+envAdminToken+"; the flag shows in ps, prefer the env)")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "bound on each request to the router (for tail: on connecting)")
	fs.BoolVar(&o.json, "json", false, "print JSON for scripts instead of a table")
	fs.StringVar(&o.ca, "ca", os.Getenv(envAdminCA), "PEM file of the CA the router's certificate is checked against (env "+envAdminCA+"; default: the system's)")
	fs.StringVar(&o.cert, "cert", os.Getenv(envAdminCert), "PEM client certificate for a router that requires one (mutual TLS; env "+envAdminCert+")")
	fs.StringVar(&o.key, "key", os.Getenv(envAdminKey), "PEM key of --cert (env "+envAdminKey+")")
}

// adminFlagSet is the flag set of a command that talks to the router: the
// admin flags on o, and a --help that prints usage (the command's own text,
// ending in "Flags:"), its flags, then the common flags.
func adminFlagSet(name string, stdout io.Writer, o *adminOpts, usage string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stdout)
	addAdminFlags(fs, o)
	cli.SetUsage(fs, stdout, usage+"\n", "\n"+adminFlagsHelp+"\n")
	return fs
}

const adminFlagsHelp = `Common flags:
  --router URL     router admin API (env KVROUTER_ADMIN_URL, default http://127.0.0.1:8081)
  --token T        admin bearer token (env KVROUTER_ADMIN_TOKEN)
  --timeout D      bound on each request, e.g. 5s (default 10s)
  --ca FILE        PEM CA of the router's certificate (env KVROUTER_ADMIN_CA; default: the system's)
  --cert, --key    PEM client certificate and key, for a router with mutual TLS
                   (env KVROUTER_ADMIN_CERT, KVROUTER_ADMIN_KEY)
  --json           JSON output for scripts`

// adminClient calls the router's admin API.
type adminClient struct {
	base    *url.URL
	token   string
	timeout time.Duration
	hc      *http.Client
}

// client validates the options and builds the client.
func (o *adminOpts) client() (*adminClient, error) {
	u, err := url.Parse(strings.TrimRight(o.router, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%w: --router %q: want an http:// or https:// URL such as %s", errUsage, o.router, defaultAdminURL)
	}
	if o.timeout <= 0 {
		return nil, fmt.Errorf("%w: --timeout %s: must be positive", errUsage, o.timeout)
	}
	// Proxy is nil: the admin API is usually on loopback or a cluster
	// address that an HTTP proxy from the environment cannot reach.
	tlsCfg, err := o.tlsConfig()
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{
		DialContext:           (&net.Dialer{Timeout: o.timeout}).DialContext,
		TLSHandshakeTimeout:   o.timeout,
		ResponseHeaderTimeout: o.timeout,
		TLSClientConfig:       tlsCfg,
	}
	return &adminClient{base: u, token: o.token, timeout: o.timeout, hc: &http.Client{Transport: tr}}, nil
}

// tlsConfig is the client's TLS from --ca, --cert and --key; nil (Go's
// defaults) when none is given.
func (o *adminOpts) tlsConfig() (*tls.Config, error) {
	if o.ca == "" && o.cert == "" && o.key == "" {
		return nil, nil
	}
	if (o.cert == "") != (o.key == "") {
		return nil, fmt.Errorf("%w: --cert and --key go together", errUsage)
	}
	cfg, err := pemfile.ClientTLS(o.ca, o.cert, o.key)
	if err != nil {
		return nil, fmt.Errorf("%w: --ca, --cert, --key: %v", errUsage, err)
	}
	return cfg, nil
}

// parseClient parses the flags of a command that takes no positional
// arguments and builds its client.
func (o *adminOpts) parseClient(fs *flag.FlagSet, args []string) (*adminClient, error) {
	if err := parseFlags(fs, args); err != nil {
		return nil, err
	}
	return o.client()
}

// httpError is a non-2xx answer from the router, with the message of its
// OpenAI-shaped error body when it has one.
type httpError struct {
	Method  string
	URL     string
	Status  int
	Message string
	Hint    string
}

func (e *httpError) Error() string {
	s := fmt.Sprintf("%s %s: %d %s", e.Method, e.URL, e.Status, http.StatusText(e.Status))
	if e.Message != "" {
		s += ": " + e.Message
	}
	if e.Hint != "" {
		s += " (" + e.Hint + ")"
	}
	return s
}

// errorMessage extracts the message of an error body: the router writes
// {"error": {"message": ...}}; handlers built on http.Error write plain text.
func errorMessage(body []byte) string {
	var oe struct {
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &oe) == nil && oe.Error != nil && oe.Error.Message != "" {
		return oe.Error.Message
	}
	s := strings.TrimSpace(string(body))
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}

func newHTTPError(method, u string, status int, body []byte) *httpError {
	e := &httpError{Method: method, URL: u, Status: status, Message: errorMessage(body)}
	switch {
	case status == http.StatusUnauthorized:
		e.Hint = "set --token or " + envAdminToken
	case status == http.StatusNotFound && !routerAnswer(body, e.Message):
		// Not an answer of the router's handlers (a pool, model or
		// instance it does not have): the path itself is unknown.
		e.Hint = "this router does not serve that endpoint; check that --router is its admin listener and that it is new enough"
	}
	return e
}

// routerAnswer reports whether a 404's body came from one of the admin
// API's handlers: an OpenAI error object (every JSON handler's), or the
// eviction stream's plain "unknown pool" — not the mux's "404 page not
// found" for a path it has no route for.
func routerAnswer(body []byte, msg string) bool {
	var oe struct {
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &oe) == nil && oe.Error != nil {
		// The data listener (admin API mounted there) answers a path it
		// has no route for with an error object too.
		return !strings.HasPrefix(oe.Error.Message, adminapi.NoRoute)
	}
	return strings.HasPrefix(msg, "unknown pool")
}

// request builds a request for path (already escaped) on the admin API.
func (c *adminClient) request(ctx context.Context, method, path string, body []byte) (*http.Request, error) {
	u := c.base.String() + path
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, fmt.Errorf("build request %s %s: %w", method, u, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	return req, nil
}

// connError turns a transport failure into a message an operator can act on.
func (c *adminClient) connError(method, u string, err error) error {
	// *url.Error repeats method and URL, which the message already has.
	if ue := (*url.Error)(nil); errors.As(err, &ue) {
		err = ue.Err
	}
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("%s %s: connection refused: is kvrouter running with its admin API there? (set --router or %s): %w", method, u, envAdminURL, err)
	case errors.Is(err, context.DeadlineExceeded) || isTimeout(err):
		return fmt.Errorf("%s %s: no answer within %s (--timeout): %w", method, u, c.timeout, err)
	}
	return fmt.Errorf("%s %s: %w", method, u, err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// call sends one request and returns the body of a 2xx answer; any other
// status is an *httpError.
func (c *adminClient) call(ctx context.Context, method, path string, in any) ([]byte, error) {
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return nil, fmt.Errorf("encode request: %w", err)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := c.request(ctx, method, path, body)
	if err != nil {
		return nil, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, c.connError(method, req.URL.String(), err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxAdminResponse+1))
	if err != nil {
		return nil, c.connError(method, req.URL.String(), fmt.Errorf("read answer: %w", err))
	}
	if len(b) > maxAdminResponse {
		return nil, fmt.Errorf("%s %s: answer larger than %d bytes", method, req.URL, maxAdminResponse)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, newHTTPError(method, req.URL.String(), resp.StatusCode, b)
	}
	return b, nil
}

// callJSON is call with the answer decoded into out.
func (c *adminClient) callJSON(ctx context.Context, method, path string, in, out any) ([]byte, error) {
	b, err := c.call(ctx, method, path, in)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, out); err != nil {
		return nil, fmt.Errorf("%s %s: answer is not the JSON kvctl expects: %w", method, c.base.String()+path, err)
	}
	return b, nil
}

// poolPath is /admin/pools/{pool}/rest with the pool name escaped.
func poolPath(pool, rest string) string {
	p := "/admin/pools/" + url.PathEscape(pool)
	if rest != "" {
		p += "/" + rest
	}
	return p
}

// writeIndented prints a JSON answer indented, whatever its original layout.
func writeIndented(w io.Writer, b []byte) error {
	var buf bytes.Buffer
	if err := json.Indent(&buf, bytes.TrimSpace(b), "", "  "); err != nil {
		return fmt.Errorf("answer is not JSON: %w", err)
	}
	buf.WriteByte('\n')
	_, err := w.Write(buf.Bytes())
	return err
}

// writeJSONValue prints v as indented JSON.
func writeJSONValue(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// parseFlags parses args for a command that takes no positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("%w: unexpected argument %q (flags only)", errUsage, fs.Arg(0))
	}
	return nil
}

// requirePool checks --pool was given.
func requirePool(fs *flag.FlagSet, pool string) error {
	if pool == "" {
		fs.Usage()
		return fmt.Errorf("%w: --pool is required", errUsage)
	}
	return nil
}
