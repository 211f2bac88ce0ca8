package workload

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"time"
)

// TraceBlockTokens is the Mooncake traces' hash_id block size (FAST'25 release README).
const TraceBlockTokens = 512

// TraceRecord is one line of a Mooncake-format trace.
type TraceRecord struct {
	// Timestamp is the arrival time in milliseconds from the trace start.
	Timestamp int64 `json:"timestamp"`
	// InputLength and OutputLength are token counts.
	InputLength  int `json:"input_length"`
	OutputLength int `json:"output_length"`
	// HashIDs name the prompt's blocks; an id covers its block and every
	// block before it, so equal ids mean equal prefixes.
	HashIDs []int64 `json:"hash_ids"`
}

// maxTraceLine bounds one JSON line (a 200k-token prompt has ~400 ids).
const maxTraceLine = 16 << 20

// ReadTrace reads a Mooncake-format trace (JSON lines, plain or gzip): one
// record per non-empty line. Any malformed line is an error naming it.
func ReadTrace(r io.Reader) ([]TraceRecord, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	if magic, err := br.Peek(2); err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("workload: trace: gzip: %w", err)
		}
		defer zr.Close()
		br = bufio.NewReaderSize(zr, 64<<10)
	}
	sc := bufio.NewScanner(br)
	sc.Buffer(make([]byte, 0, 64<<10), maxTraceLine)
	var recs []TraceRecord
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var in traceLine
		dec := json.NewDecoder(bytes.NewReader(b))
		if err := dec.Decode(&in); err != nil {
			return nil, fmt.Errorf("%w: trace line %d: %v", ErrInvalid, line, err)
		}
		rec, err := in.record()
		if err != nil {
			return nil, fmt.Errorf("trace line %d: %w", line, err)
		}
		if err := rec.validate(); err != nil {
			return nil, fmt.Errorf("trace line %d: %w", line, err)
		}
		recs = append(recs, rec)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("workload: trace: after line %d: %w", line, err)
	}
	return recs, nil
}

// traceLine is a record as a line holds it. The timestamp is any JSON
// number of milliseconds: Mooncake's own traces write integers, other
// tools that read and write the format take fractions too (AISBench's
// mooncake_trace dataset documents "int or float"), so a fraction is kept
// to the nearest millisecond rather than refused.
type traceLine struct {
	Timestamp    json.RawMessage `json:"timestamp"`
	InputLength  int             `json:"input_length"`
	OutputLength int             `json:"output_length"`
	HashIDs      []int64         `json:"hash_ids"`
}

// maxTraceMillis bounds a timestamp (about 292 years: far past any trace,
// and short of int64 nanoseconds' overflow when replayed).
const maxTraceMillis = math.MaxInt64 / int64(time.Millisecond)

func (l traceLine) record() (TraceRecord, error) {
	r := TraceRecord{InputLength: l.InputLength, OutputLength: l.OutputLength, HashIDs: l.HashIDs}
	raw := string(l.Timestamp)
	if raw == "" || raw == "null" {
		return r, nil // none: at the start, as Mooncake's first record
	}
	n := json.Number(raw)
	if ms, err := n.Int64(); err == nil {
		r.Timestamp = ms
		return r, nil
	}
	f, err := n.Float64()
	switch {
	case err != nil: // a string, a boolean, an object: the decoder passes only JSON values, never NaN
		return r, fmt.Errorf("%w: timestamp %s is not a number of milliseconds", ErrInvalid, raw)
	case f < 0:
		return r, fmt.Errorf("%w: negative timestamp %s", ErrInvalid, raw)
	case f > float64(maxTraceMillis):
		return r, fmt.Errorf("%w: timestamp %s ms is past %d", ErrInvalid, raw, maxTraceMillis)
	}
	r.Timestamp = int64(math.Round(f))
	return r, nil
}

func (r *TraceRecord) validate() error {
	switch {
	case r.Timestamp < 0:
		return fmt.Errorf("%w: negative timestamp %d", ErrInvalid, r.Timestamp)
	case r.Timestamp > maxTraceMillis:
		return fmt.Errorf("%w: timestamp %d ms is past %d", ErrInvalid, r.Timestamp, maxTraceMillis)
	case r.InputLength <= 0:
		return fmt.Errorf("%w: input_length %d must be positive", ErrInvalid, r.InputLength)
	case r.OutputLength < 0:
		return fmt.Errorf("%w: negative output_length %d", ErrInvalid, r.OutputLength)
	case len(r.HashIDs) == 0:
		return fmt.Errorf("%w: no hash_ids", ErrInvalid)
	case r.InputLength > len(r.HashIDs)*TraceBlockTokens:
		return fmt.Errorf("%w: input_length %d exceeds %d hash_ids of %d tokens", ErrInvalid, r.InputLength, len(r.HashIDs), TraceBlockTokens)
	case r.InputLength <= (len(r.HashIDs)-1)*TraceBlockTokens:
		return fmt.Errorf("%w: input_length %d leaves hash_ids beyond the prompt (%d ids)", ErrInvalid, r.InputLength, len(r.HashIDs))
	}
	return nil
}

// OpenTrace reads a trace file (plain or gzip), or the bundled trace
// DefaultTracePath names.
func OpenTrace(path string) ([]TraceRecord, error) {
	if recs, ok, err := openBuiltin(path); ok {
		return recs, err
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("workload: trace: %w", err)
	}
	defer f.Close()
	recs, err := ReadTrace(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}

// TraceReplay turns trace records into a workload. The zero value replays
// at the trace's own timestamps, every record.
type TraceReplay struct {
	// Name of the workload (default "trace").
	Name string `json:"name,omitempty"`
	// Speed divides inter-arrival times: 2 replays twice as fast (default 1).
	Speed float64 `json:"speed,omitempty"`
	// Limit keeps only the first Limit records (0 = all).
	Limit int `json:"limit,omitempty"`
	// MaxOutputTokens caps output lengths (0 = no cap).
	MaxOutputTokens int `json:"max_output_tokens,omitempty"`
}

// traceSeed namespaces hash-id segments: it is fixed, not the run seed,
// so that a trace always maps to the same tokens.
var traceSeed = derive(0, "mooncake-hash-id", 0)

// Workload builds the replay: hash id h becomes a segment of 512 tokens
// determined by h alone (so equal ids share tokens exactly), the last one
// truncated to input_length.
func (c TraceReplay) Workload(recs []TraceRecord) (*Workload, error) {
	if c.Name == "" {
		c.Name = "trace"
	}
	if c.Speed == 0 {
		c.Speed = 1
	}
	if !(c.Speed > 0) || math.IsInf(c.Speed, 0) || c.Limit < 0 || c.MaxOutputTokens < 0 {
		return nil, fmt.Errorf("%w: trace replay: need speed > 0, limit >= 0, max_output_tokens >= 0", ErrInvalid)
	}
	if c.Limit > 0 && c.Limit < len(recs) {
		recs = recs[:c.Limit]
	}
	w := &Workload{Name: c.Name, Requests: make([]Request, 0, len(recs))}
	var t0 int64
	if len(recs) > 0 {
		t0 = recs[0].Timestamp
		for _, r := range recs {
			t0 = min(t0, r.Timestamp)
		}
	}
	for i := range recs {
		r := &recs[i]
		if err := r.validate(); err != nil {
			return nil, fmt.Errorf("trace record %d: %w", i, err)
		}
		p := make([]Segment, len(r.HashIDs))
		for j, h := range r.HashIDs {
			n := TraceBlockTokens
			if j == len(r.HashIDs)-1 {
				n = r.InputLength - j*TraceBlockTokens
			}
			p[j] = Segment{Seed: mix(traceSeed ^ uint64(h)), Len: n}
		}
		// A record of no output (0, or none given) still prefills its
		// prompt, whose first token is what TTFT times: it is replayed
		// asking one token, as engines refuse a request for none (vLLM's
		// max_tokens is at least 1) and other readers of the format
		// default a missing output_length to 1 (AISBench's mooncake_trace).
		out := max(r.OutputLength, 1)
		if c.MaxOutputTokens > 0 {
			out = min(out, c.MaxOutputTokens)
		}
		at := time.Duration(float64(r.Timestamp-t0) / c.Speed * float64(time.Millisecond))
		w.Requests = append(w.Requests, Request{At: at, Prompt: p, OutputTokens: out})
	}
	return w.finish(), nil
}

// TraceStats summarises a trace (the quantities traces/README.md tabulates).
type TraceStats struct {
	Requests       int     `json:"requests"`
	DurationSec    float64 `json:"duration_sec"`
	RatePerSec     float64 `json:"rate_per_sec"`
	InputMean      float64 `json:"input_mean"`
	InputMedian    float64 `json:"input_median"`
	InputP90       float64 `json:"input_p90"`
	InputMin       int     `json:"input_min"`
	InputMax       int     `json:"input_max"`
	OutputMean     float64 `json:"output_mean"`
	OutputMedian   float64 `json:"output_median"`
	OutputP90      float64 `json:"output_p90"`
	OutputMax      int     `json:"output_max"`
	Blocks         int64   `json:"blocks"`
	DistinctBlocks int     `json:"distinct_blocks"`
}

// Stats computes a trace's summary; percentiles interpolate linearly.
func Stats(recs []TraceRecord) TraceStats {
	var s TraceStats
	s.Requests = len(recs)
	if len(recs) == 0 {
		return s
	}
	in := make([]float64, len(recs))
	out := make([]float64, len(recs))
	seen := map[int64]struct{}{}
	tmin, tmax := recs[0].Timestamp, recs[0].Timestamp
	s.InputMin = recs[0].InputLength
	for i, r := range recs {
		in[i], out[i] = float64(r.InputLength), float64(r.OutputLength)
		s.InputMean += in[i]
		s.OutputMean += out[i]
		s.InputMin = min(s.InputMin, r.InputLength)
		s.InputMax = max(s.InputMax, r.InputLength)
		s.OutputMax = max(s.OutputMax, r.OutputLength)
		tmin, tmax = min(tmin, r.Timestamp), max(tmax, r.Timestamp)
		s.Blocks += int64(len(r.HashIDs))
		for _, h := range r.HashIDs {
			seen[h] = struct{}{}
		}
	}
	n := float64(len(recs))
	s.InputMean /= n
	s.OutputMean /= n
	s.DistinctBlocks = len(seen)
	s.DurationSec = float64(tmax-tmin) / 1000
	if s.DurationSec > 0 {
		s.RatePerSec = n / s.DurationSec
	}
	sort.Float64s(in)
	sort.Float64s(out)
	s.InputMedian, s.InputP90 = Quantile(in, 0.5), Quantile(in, 0.9)
	s.OutputMedian, s.OutputP90 = Quantile(out, 0.5), Quantile(out, 0.9)
	return s
}

// Quantile of sorted values with linear interpolation (numpy's default);
// NaN for no values.
func Quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	pos := q * float64(len(sorted)-1)
	lo := int(math.Floor(pos))
	hi := min(lo+1, len(sorted)-1)
	return sorted[lo] + (pos-float64(lo))*(sorted[hi]-sorted[lo])
}
