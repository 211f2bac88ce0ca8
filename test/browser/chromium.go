// Package browser drives a real headless Chromium over the DevTools
// protocol, for tests of the router's built-in dashboard: launch, navigate,
// evaluate JavaScript in the page, take a screenshot. Just enough of the
// protocol for that, over golang.org/x/net/websocket (already in the module
// graph through gRPC), so the tests need no browser-automation dependency.
package browser

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/websocket"
)

// ErrNoChromium is returned by Find when no Chromium binary is available.
var ErrNoChromium = errors.New("browser: no chromium found (run scripts/ensure-browser.sh, or set CHROMIUM=/path/to/chrome)")

// Find returns the Chromium binary: $CHROMIUM, else chromium,
// chromium-browser or google-chrome on PATH.
func Find() (string, error) {
	if p := os.Getenv("CHROMIUM"); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("browser: CHROMIUM=%s: %w", p, err)
		}
		return p, nil
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome-stable", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", ErrNoChromium
}

// Flags returns the command-line flags Launch passes. Without the network ones
// Chromium tries to reach Google's services, which this machine's closed
// network refuses; --no-sandbox because tests may run as root in a
// container; --remote-allow-origins because the websocket client sends an
// Origin header, which DevTools otherwise rejects (Chromium ≥ 111).
func Flags() []string {
	return []string{
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-default-apps", "--disable-extensions", "--no-default-browser-check",
		"--disable-dev-shm-usage", "--no-proxy-server", "--hide-scrollbars", "--mute-audio",
		"--remote-debugging-port=0", "--remote-allow-origins=*",
	}
}

// Config configures Launch. Zero values mean defaults.
type Config struct {
	// Binary is the Chromium executable (default: Find).
	Binary string
	// Width and Height of the window (default 1400×1000).
	Width, Height int
	// StartTimeout bounds the wait for the DevTools endpoint (default 30s).
	StartTimeout time.Duration
	// Stderr receives Chromium's stderr (default: discarded).
	Stderr *os.File
}

// Browser is a running headless Chromium. Close stops it.
type Browser struct {
	cmd     *exec.Cmd
	dir     string
	devtool string // host:port of the DevTools HTTP endpoint
	waited  chan struct{}
}

// Launch starts Chromium with a fresh profile in a temporary directory.
func Launch(ctx context.Context, cfg Config) (*Browser, error) {
	if cfg.Binary == "" {
		p, err := Find()
		if err != nil {
			return nil, err
		}
		cfg.Binary = p
	}
	if cfg.Width == 0 {
		cfg.Width = 1400
	}
	if cfg.Height == 0 {
		cfg.Height = 1000
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = 30 * time.Second
	}
	dir, err := os.MkdirTemp("", "kvrouter-chromium-")
	if err != nil {
		return nil, fmt.Errorf("browser: profile dir: %w", err)
	}
	args := Flags()
	args = append(args, "--user-data-dir="+dir, fmt.Sprintf("--window-size=%d,%d", cfg.Width, cfg.Height), "about:blank")
	cmd := exec.Command(cfg.Binary, args...)
	// Its own process group, so Close stops the renderer and helper
	// processes along with the browser.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Stdout = nil
	if cfg.Stderr != nil {
		cmd.Stderr = cfg.Stderr
	}
	if err := cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("browser: start %s: %w", cfg.Binary, err)
	}
	b := &Browser{cmd: cmd, dir: dir, waited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(b.waited) }()
	// Chromium writes the port it picked into DevToolsActivePort.
	deadline := time.Now().Add(cfg.StartTimeout)
	for {
		data, err := os.ReadFile(filepath.Join(dir, "DevToolsActivePort"))
		if err == nil {
			if port, _, perr := ParseActivePort(data); perr == nil {
				b.devtool = "127.0.0.1:" + strconv.Itoa(port)
				return b, nil
			}
		}
		select {
		case <-b.waited:
			b.Close()
			return nil, fmt.Errorf("browser: %s exited before DevTools came up: %v", cfg.Binary, cmd.ProcessState)
		case <-ctx.Done():
			b.Close()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			b.Close()
			return nil, fmt.Errorf("browser: no DevToolsActivePort after %v", cfg.StartTimeout)
		}
	}
}

// ParseActivePort parses Chromium's DevToolsActivePort file: the port on
// the first line, the browser target's websocket path on the second.
func ParseActivePort(data []byte) (port int, path string, err error) {
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) < 1 || lines[0] == "" {
		return 0, "", errors.New("browser: empty DevToolsActivePort")
	}
	port, err = strconv.Atoi(strings.TrimSpace(lines[0]))
	if err != nil || port <= 0 || port > 65535 {
		return 0, "", fmt.Errorf("browser: bad DevTools port %q", lines[0])
	}
	if len(lines) > 1 {
		path = strings.TrimSpace(lines[1])
	}
	return port, path, nil
}

// Close stops Chromium and removes its profile.
func (b *Browser) Close() {
	if b.cmd.Process != nil {
		_ = syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
		<-b.waited
	}
	_ = os.RemoveAll(b.dir)
}

// Page connects to the first page target (the about:blank tab Chromium
// opened at start).
func (b *Browser) Page(ctx context.Context) (*Page, error) {
	client := &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 10 * time.Second}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.devtool+"/json/list", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("browser: list targets: %w", err)
	}
	defer resp.Body.Close()
	var targets []struct {
		Type string `json:"type"`
		WS   string `json:"webSocketDebuggerUrl"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&targets); err != nil {
		return nil, fmt.Errorf("browser: decode targets: %w", err)
	}
	for _, t := range targets {
		if t.Type == "page" && t.WS != "" {
			cfg, err := websocket.NewConfig(t.WS, "http://127.0.0.1/")
			if err != nil {
				return nil, err
			}
			ws, err := websocket.DialConfig(cfg)
			if err != nil {
				return nil, fmt.Errorf("browser: connect %s: %w", t.WS, err)
			}
			// Screenshots arrive as one base64 message of a few MB.
			ws.MaxPayloadBytes = 64 << 20
			return &Page{ws: ws}, nil
		}
	}
	return nil, errors.New("browser: no page target")
}

// Page is one tab, driven over its DevTools websocket. Calls are
// serialised.
type Page struct {
	mu     sync.Mutex // guards ws and nextID: one command in flight at a time
	ws     *websocket.Conn
	nextID int64
}

// Close closes the DevTools connection.
func (p *Page) Close() error { return p.ws.Close() }

// Call sends one DevTools command and returns its result, skipping the
// protocol events that arrive meanwhile.
func (p *Page) Call(ctx context.Context, method string, params any, result any) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.nextID++
	id := p.nextID
	msg, err := json.Marshal(map[string]any{"id": id, "method": method, "params": params})
	if err != nil {
		return err
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(30 * time.Second)
	}
	_ = p.ws.SetDeadline(deadline)
	if err := websocket.Message.Send(p.ws, string(msg)); err != nil {
		return fmt.Errorf("browser: send %s: %w", method, err)
	}
	for {
		var raw []byte
		if err := websocket.Message.Receive(p.ws, &raw); err != nil {
			return fmt.Errorf("browser: %s: receive: %w", method, err)
		}
		var resp struct {
			ID     int64           `json:"id"`
			Result json.RawMessage `json:"result"`
			Error  *struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(raw, &resp); err != nil {
			return fmt.Errorf("browser: %s: malformed reply: %w", method, err)
		}
		if resp.ID != id {
			continue // an event, or a late reply
		}
		if resp.Error != nil {
			return fmt.Errorf("browser: %s: %d %s", method, resp.Error.Code, resp.Error.Message)
		}
		if result == nil {
			return nil
		}
		return json.Unmarshal(resp.Result, result)
	}
}

// Navigate loads url and waits for its load event (polled through
// document.readyState, so no event subscription is needed).
func (p *Page) Navigate(ctx context.Context, url string) error {
	var r struct {
		ErrorText string `json:"errorText"`
	}
	if err := p.Call(ctx, "Page.navigate", map[string]any{"url": url}, &r); err != nil {
		return err
	}
	if r.ErrorText != "" {
		return fmt.Errorf("browser: navigate %s: %s", url, r.ErrorText)
	}
	for {
		var state string
		if err := p.Eval(ctx, "document.readyState", &state); err == nil && state == "complete" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("browser: %s did not finish loading: %w", url, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Eval evaluates a JavaScript expression in the page (awaiting it when it
// is a promise) and decodes its JSON value into out (nil = ignore).
func (p *Page) Eval(ctx context.Context, expr string, out any) error {
	var r struct {
		Result struct {
			Type  string          `json:"type"`
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		Exception *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	err := p.Call(ctx, "Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true, "awaitPromise": true}, &r)
	if err != nil {
		return err
	}
	if r.Exception != nil {
		return fmt.Errorf("browser: evaluate %q: %s %s", expr, r.Exception.Text, r.Exception.Exception.Description)
	}
	if out == nil || len(r.Result.Value) == 0 {
		return nil
	}
	return json.Unmarshal(r.Result.Value, out)
}

// Screenshot returns a PNG of the whole page (beyond the window when the
// page is taller).
func (p *Page) Screenshot(ctx context.Context) ([]byte, error) {
	var r struct {
		Data string `json:"data"`
	}
	if err := p.Call(ctx, "Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true}, &r); err != nil {
		return nil, err
	}
	png, err := base64.StdEncoding.DecodeString(r.Data)
	if err != nil {
		return nil, fmt.Errorf("browser: screenshot: %w", err)
	}
	return png, nil
}
