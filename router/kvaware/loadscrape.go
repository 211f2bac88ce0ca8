package kvaware

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/kvrouter/kvrouter/router"
	"io"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Errors of the /metrics load scraper.
var (
	// ErrMetricsFormat: a /metrics body is not Prometheus text format, or
	// carries neither of vLLM's request gauges.
	ErrMetricsFormat = errors.New("router: malformed metrics text")
)

// maxMetricsBytes caps one /metrics body: vLLM's is ~30-100 KB (histograms
// per model), a body beyond 4 MiB is not a vLLM engine's.
const maxMetricsBytes = 4 << 20

// loadSample is one instance's engine-reported load.
type loadSample struct {
	waiting float64 // vllm:num_requests_waiting, summed over series (DP ranks)
	running float64 // vllm:num_requests_running
	// at is when the sample was asked for and got when it arrived: the
	// engine took it in between (both equal for a sample set directly).
	at, got time.Time
}

// loadStore holds the latest sample per instance.
type loadStore struct {
	mu      sync.RWMutex // guards samples, the slots' contents, live and made
	samples map[string]*loadSlot
	live    int   // slots holding a sample
	made    int64 // slots made (a candidate index's miss stands while this does)
}

// loadSlot is one instance's sample: made once per instance id and
// removed only when the instance leaves the pool (forget; a dropped
// sample clears ok), so that a candidate index (kvaware_cands.go) keeps a
// pointer to it rather than hashing the instance's id in every decision;
// like the pending counters, one per instance id in the pool.
type loadSlot struct {
	ls loadSample
	ok bool
}

func (s *loadStore) set(inst string, ls loadSample) {
	s.mu.Lock()
	if s.samples == nil {
		s.samples = make(map[string]*loadSlot)
	}
	sl := s.samples[inst]
	if sl == nil {
		sl = &loadSlot{}
		s.samples[inst] = sl
		s.made++
	}
	if !sl.ok {
		s.live++
	}
	sl.ls, sl.ok = ls, true
	s.mu.Unlock()
}

func (s *loadStore) drop(inst string) {
	s.mu.Lock()
	if sl := s.samples[inst]; sl != nil && sl.ok {
		sl.ls, sl.ok = loadSample{}, false
		s.live--
	}
	s.mu.Unlock()
}

// forget removes inst's slot: the instance left the pool. made still
// counts it, so that no candidate index's miss stands for a slot made
// again when the instance returns.
func (s *loadStore) forget(inst string) {
	s.mu.Lock()
	if sl := s.samples[inst]; sl != nil {
		if sl.ok {
			s.live--
		}
		delete(s.samples, inst)
	}
	s.mu.Unlock()
}

// get returns inst's sample if it is younger than maxAge.
func (s *loadStore) get(inst string, now time.Time, maxAge time.Duration) (loadSample, bool) {
	s.mu.RLock()
	sl := s.samples[inst]
	var ls loadSample
	ok := sl != nil && sl.ok
	if ok {
		ls = sl.ls
	}
	s.mu.RUnlock()
	if !ok || now.Sub(ls.at) > maxAge {
		return loadSample{}, false
	}
	return ls, true
}

// ParseVLLMLoad reads vLLM's request gauges from a Prometheus text-format
// exposition: the sums over all series (data-parallel ranks, models) of
// vllm:num_requests_waiting and vllm:num_requests_running (the
// underscore-only spellings are accepted too). Comments, other metrics,
// timestamps and unknown lines are skipped; NaN, infinite and negative
// samples are ignored. found is false when neither gauge appears, which
// the caller treats as "no load information" rather than "idle".
func ParseVLLMLoad(text []byte) (waiting, running float64, found bool) {
	for len(text) > 0 {
		var line []byte
		if i := bytes.IndexByte(text, '\n'); i >= 0 {
			line, text = text[:i], text[i+1:]
		} else {
			line, text = text, nil
		}
		name, value, ok := parseSampleLine(line)
		if !ok || math.IsNaN(value) || math.IsInf(value, 0) || value < 0 {
			continue
		}
		// Series summing past the largest float (no engine has that many
		// requests) keep the sum before the one that would overflow it.
		switch string(name) {
		case "vllm:num_requests_waiting", "vllm_num_requests_waiting":
			if sum := waiting + value; !math.IsInf(sum, 0) {
				waiting = sum
			}
			found = true
		case "vllm:num_requests_running", "vllm_num_requests_running":
			if sum := running + value; !math.IsInf(sum, 0) {
				running = sum
			}
			found = true
		}
	}
	return waiting, running, found
}

// parseSampleLine parses one exposition line `name{labels} value [ts]`.
// ok is false for comments, blank lines and anything malformed.
func parseSampleLine(line []byte) (name []byte, value float64, ok bool) {
	line = bytes.TrimRight(line, "\r")
	i := 0
	for i < len(line) && (line[i] == ' ' || line[i] == '\t') {
		i++
	}
	if i == len(line) || line[i] == '#' {
		return nil, 0, false
	}
	start := i
	for i < len(line) && isMetricNameByte(line[i]) {
		i++
	}
	if i == start {
		return nil, 0, false
	}
	name = line[start:i]
	if i < len(line) && line[i] == '{' {
		if i = skipLabels(line, i+1); i < 0 {
			return nil, 0, false
		}
	}
	if i == len(line) || (line[i] != ' ' && line[i] != '\t') {
		return nil, 0, false
	}
	for i < len(line) && (line[i] == ' ' || line[i] == '\t') {
		i++
	}
	vs := i
	for i < len(line) && line[i] != ' ' && line[i] != '\t' {
		i++
	}
	v, err := strconv.ParseFloat(string(line[vs:i]), 64)
	if err != nil {
		return nil, 0, false
	}
	return name, v, true
}

// skipLabels returns the index just past the '}' closing a label set that
// starts at line[i], honouring quoted values with backslash escapes (a value
// may contain '}' or '"'); -1 when the set is unterminated.
func skipLabels(line []byte, i int) int {
	inQuote := false
	for ; i < len(line); i++ {
		switch c := line[i]; {
		case inQuote && c == '\\':
			i++ // skip the escaped byte
		case c == '"':
			inQuote = !inQuote
		case !inQuote && c == '}':
			return i + 1
		}
	}
	return -1
}

func isMetricNameByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == ':'
}

// scrapeLoad fetches and parses one instance's /metrics.
func scrapeLoad(ctx context.Context, client *http.Client, in *router.Instance, path string, timeout time.Duration) (loadSample, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	u := *in.URL()
	u.Path = trimSlash(u.Path) + path
	u.RawQuery = ""
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return loadSample{}, fmt.Errorf("router: scrape %s: %w", in.ID(), err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return loadSample{}, fmt.Errorf("router: scrape %s: %w", in.ID(), err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return loadSample{}, fmt.Errorf("router: scrape %s: status %d", in.ID(), resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxMetricsBytes))
	if err != nil {
		return loadSample{}, fmt.Errorf("router: scrape %s: %w", in.ID(), err)
	}
	w, r, found := ParseVLLMLoad(body)
	if !found {
		return loadSample{}, fmt.Errorf("router: scrape %s: %w: no vllm:num_requests_waiting/running", in.ID(), ErrMetricsFormat)
	}
	return loadSample{waiting: w, running: r}, nil
}

func trimSlash(p string) string {
	for len(p) > 0 && p[len(p)-1] == '/' {
		p = p[:len(p)-1]
	}
	return p
}

// runScraper scrapes every instance of instances() each interval until ctx
// ends; results go to st's load store. One round's scrapes run
// concurrently and the next round starts only when they are all done, so
// a slow instance never piles up requests.
func (st *KVState) runScraper(ctx context.Context, client *http.Client, instances func() []*router.Instance, interval, timeout time.Duration, path string) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		var wg sync.WaitGroup
		for _, in := range instances() {
			wg.Go(func() {
				// The engine took the sample between the request and its
				// answer; loadended.go needs both (on the decision's
				// clock, which simulations replace).
				at := st.now()
				ls, err := scrapeLoad(ctx, client, in, path, timeout)
				if err != nil {
					if ctx.Err() != nil {
						return
					}
					st.m.scrapes.WithLabelValues(st.pool, in.ID(), "error").Inc()
					st.loads.drop(in.ID())
					st.log.Debug("load scrape failed", "pool", st.pool, "instance", in.ID(), "err", err)
					return
				}
				st.m.scrapes.WithLabelValues(st.pool, in.ID(), "ok").Inc()
				ls.at, ls.got = at, st.now()
				st.loads.set(in.ID(), ls)
			})
		}
		wg.Wait()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
