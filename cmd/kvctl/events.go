package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// maxInput bounds what kvctl reads from one file or line: captures are
// kilobytes per message; anything near this is not a capture.
const maxInput = 256 << 20

// eventJSON is one decoded event as kvctl prints it.
type eventJSON struct {
	Source        string   `json:"source,omitempty"`
	Topic         string   `json:"topic,omitempty"`
	Seq           *uint64  `json:"seq,omitempty"`
	Rank          *int     `json:"rank,omitempty"`
	TS            float64  `json:"ts"`
	Encoding      string   `json:"encoding"`
	Index         int      `json:"index"`
	Kind          string   `json:"kind"`
	Hashes        any      `json:"hashes,omitempty"`
	Parent        any      `json:"parent,omitempty"`
	Tokens        []uint32 `json:"tokens,omitempty"`
	BlockSize     int      `json:"block_size,omitempty"`
	Medium        string   `json:"medium,omitempty"`
	Tier          string   `json:"tier,omitempty"`
	LoraID        *int64   `json:"lora_id,omitempty"`
	Lora          string   `json:"lora,omitempty"`
	CacheSalt     string   `json:"cache_salt,omitempty"`
	Group         int      `json:"group"`
	SpecKind      string   `json:"spec_kind,omitempty"`
	SlidingWindow int      `json:"sliding_window,omitempty"`
	FullAttention bool     `json:"full_attention"`
}

// problemJSON reports a message that could not be decoded, or events of
// unknown type or that could not be read (the first one's reason in Error)
// skipped in one that could.
type problemJSON struct {
	Source        string  `json:"source,omitempty"`
	Topic         string  `json:"topic,omitempty"`
	Seq           *uint64 `json:"seq,omitempty"`
	Error         string  `json:"error,omitempty"`
	UnknownEvents int     `json:"unknown_events,omitempty"`
	InvalidEvents int     `json:"invalid_events,omitempty"`
}

// captureLine is the JSONL capture form (testdata/captured/DATA.md).
type captureLine struct {
	Topic      string      `json:"topic"`
	Seq        json.Number `json:"seq"`
	PayloadB64 *string     `json:"payload_b64"`
}

type decodeOpts struct {
	hex      bool
	noTokens bool
}

func runEventsDecode(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("events decode", flag.ContinueOnError)
	fs.SetOutput(stdout)
	var o decodeOpts
	fs.BoolVar(&o.hex, "hex", false, "print block hashes as 16-digit hex strings (JSON numbers above 2^53 lose precision in many tools)")
	fs.BoolVar(&o.noTokens, "no-tokens", false, "omit token ids")
	cli.SetUsage(fs, stdout, `Usage: kvctl events decode [flags] FILE

Prints a vLLM KV-event capture as one JSON object per event. FILE ('-' for
stdin) is either one raw msgpack EventBatch payload, or JSON lines carrying
the payload base64-encoded in "payload_b64" (with "topic" and "seq" when
known), as kvrouter's captures and kvbridge dumps do. Lines without a payload
(replay requests, the replay end marker) are skipped. A message that does not
decode prints {"error": ...} and makes the exit status 1.

Flags:
`, "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fmt.Errorf("%w: want exactly one FILE, got %d arguments", errUsage, fs.NArg())
	}
	in, closeIn, err := openInput(fs.Arg(0))
	if err != nil {
		return err
	}
	defer closeIn()
	br := bufio.NewReaderSize(io.LimitReader(in, maxInput), 64<<10)
	w := bufio.NewWriter(stdout)
	defer w.Flush()
	enc := json.NewEncoder(w)

	first, err := firstNonSpace(br)
	if err != nil {
		return err
	}
	if first == '{' {
		return decodeJSONL(ctx, br, fs.Arg(0), enc, o)
	}
	payload, err := io.ReadAll(br)
	if err != nil {
		return fmt.Errorf("read %s: %w", fs.Arg(0), err)
	}
	if bad := printBatch(enc, payload, problemJSON{Source: fs.Arg(0)}, o); bad {
		return fmt.Errorf("%s does not decode", fs.Arg(0))
	}
	return nil
}

func openInput(name string) (io.Reader, func(), error) {
	if name == "-" {
		return os.Stdin, func() {}, nil
	}
	f, err := os.Open(name)
	if err != nil {
		return nil, nil, err
	}
	return f, func() { f.Close() }, nil
}

// firstNonSpace peeks at the first byte that is not ASCII white space.
func firstNonSpace(br *bufio.Reader) (byte, error) {
	for i := 1; ; i++ {
		b, err := br.Peek(i)
		if err == io.EOF && len(b) < i {
			return 0, fmt.Errorf("empty input")
		}
		if err != nil && len(b) < i {
			return 0, err
		}
		switch c := b[i-1]; c {
		case ' ', '\t', '\r', '\n':
			if i >= 4096 {
				return 0, fmt.Errorf("input starts with 4 KiB of white space")
			}
			continue
		default:
			return c, nil
		}
	}
}

func decodeJSONL(ctx context.Context, br *bufio.Reader, name string, enc *json.Encoder, o decodeOpts) error {
	sc := bufio.NewScanner(br)
	sc.Buffer(make([]byte, 0, 1<<20), maxInput)
	line, messages, failed := 0, 0, 0
	for sc.Scan() {
		if err := ctx.Err(); err != nil {
			return err
		}
		line++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		where := problemJSON{Source: fmt.Sprintf("%s:%d", name, line)}
		var c captureLine
		dec := json.NewDecoder(bytes.NewReader(text))
		dec.UseNumber()
		if err := dec.Decode(&c); err != nil {
			where.Error = "not a JSON object: " + err.Error()
			failed++
			enc.Encode(where)
			continue
		}
		where.Topic = c.Topic
		if s, err := strconv.ParseUint(string(c.Seq), 10, 64); err == nil {
			where.Seq = &s
		}
		if c.PayloadB64 == nil || *c.PayloadB64 == "" {
			continue // replay request or end-of-replay marker
		}
		messages++
		payload, err := base64.StdEncoding.DecodeString(*c.PayloadB64)
		if err != nil {
			where.Error = "payload_b64: " + err.Error()
			failed++
			enc.Encode(where)
			continue
		}
		if printBatch(enc, payload, where, o) {
			failed++
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("%s line %d: %w", name, line+1, err)
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d messages in %s failed to decode", failed, messages, name)
	}
	return nil
}

// printBatch decodes one payload and prints its events; it reports whether
// the payload failed to decode.
func printBatch(enc *json.Encoder, payload []byte, where problemJSON, o decodeOpts) (failed bool) {
	b, err := events.Decode(payload)
	if err != nil {
		where.Error = err.Error()
		enc.Encode(where)
		return true
	}
	var rank *int
	if b.HasDPRank {
		rank = &b.DPRank
	}
	for i, e := range b.Events {
		j := eventJSON{
			Source: where.Source, Topic: where.Topic, Seq: where.Seq, Rank: rank,
			TS: b.TS, Encoding: e.Layout.Encoding.String(), Index: i, Kind: e.Kind.String(),
			BlockSize: e.BlockSize, Medium: e.Medium, Lora: e.LoraName, CacheSalt: e.CacheSalt,
			Group: e.GroupIdx, SpecKind: e.SpecKind, SlidingWindow: e.SlidingWindow,
			FullAttention: e.FullAttention(),
		}
		if e.Kind != events.AllBlocksCleared {
			t, _ := tiers.FromMedium(e.Medium)
			j.Tier = t.String()
			j.Hashes = hashesJSON(e.BlockHashes, o.hex)
		}
		if e.HasParent {
			j.Parent = hashJSON(e.ParentHash, o.hex)
		}
		if !o.noTokens {
			j.Tokens = e.TokenIDs
		}
		if e.HasLoraID {
			id := e.LoraID
			j.LoraID = &id
		}
		enc.Encode(j)
	}
	if b.Unknown > 0 || b.Invalid > 0 {
		where.UnknownEvents, where.InvalidEvents = b.Unknown, b.Invalid
		if b.InvalidErr != nil {
			where.Error = b.InvalidErr.Error()
		}
		enc.Encode(where)
	}
	return false
}

func hashJSON(h uint64, hex bool) any {
	if hex {
		return fmt.Sprintf("%016x", h)
	}
	return h
}

func hashesJSON(hs []uint64, hex bool) any {
	if !hex {
		if hs == nil {
			return []uint64{}
		}
		return hs
	}
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = fmt.Sprintf("%016x", h)
	}
	return out
}
