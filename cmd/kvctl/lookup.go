package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"text/tabwriter"
	"unicode"

	"github.com/kvrouter/kvrouter/router/admin/adminapi"
)

// maxLookupFile bounds a prompt or token file: the longest contexts are
// about a million tokens, a few megabytes as text or decimal ids.
const maxLookupFile = 64 << 20

// lookupAnswer is POST /admin/pools/{pool}/lookup's answer:
// {"pool": "llama", "block_size": 16, "prompt_tokens": 40, "blocks": 2,
// "matches": [{"instance": "vllm-0", "gpu_blocks": 2, "cpu_blocks": 0,
// ..., "live": true}]}, each tier's blocks counted beyond the faster tiers'.
type (
	lookupAnswer = adminapi.KVLookupResponse
	lookupMatch  = adminapi.KVLookupMatch
)

// matchTotal is the blocks m holds over every tier.
func matchTotal(m lookupMatch) int {
	return m.GPUBlocks + m.CPUBlocks + m.DiskBlocks + m.SharedBlocks
}

func runLookup(ctx context.Context, args []string, stdout io.Writer) error {
	var o adminOpts
	fs := adminFlagSet("lookup", stdout, &o, `Usage: kvctl lookup --pool P (--prompt-file F | --chat-file F | --tokens F)

Asks the router which instances hold the prompt's KV blocks
(POST /admin/pools/{pool}/lookup), and prints, per instance, the contiguous
prefix it holds on GPU, then beyond that on CPU, disk and shared storage, in
blocks and tokens. With --tokens the ids are sent as they are (token ids as
the engine sees them, e.g. from 'kvctl tokenize'); with --prompt-file the
router tokenizes the text itself, and with --chat-file it renders the chat
messages with the pool's chat template first, as for /v1/chat/completions;
both need a tokenizer configured for the pool.

Examples:
  kvctl lookup --pool llama --tokens ids.json
  echo '128000 9906 1917' | kvctl lookup --pool llama --tokens -
  kvctl lookup --pool llama --prompt-file prompt.txt --json
  kvctl lookup --pool llama --chat-file request.json     # {"model":..., "messages":[...]}

Flags:`)
	pool := fs.String("pool", "", "pool whose index to ask (required)")
	promptFile := fs.String("prompt-file", "", "file holding the prompt text, sent as is ('-' for stdin); the router tokenizes it with the pool's tokenizer")
	tokensFile := fs.String("tokens", "", "file of token ids: a JSON array, or integers separated by whitespace or commas ('-' for stdin)")
	chatFile := fs.String("chat-file", "", "file holding chat messages ('-' for stdin): a JSON array of {role, content}, or a whole chat request with \"messages\"; the router renders and tokenizes them as a chat request")
	adapter := fs.String("adapter", "", "LoRA adapter the request would name (its blocks are keyed apart from the base model's)")
	cacheSalt := fs.String("cache-salt", "", "cache_salt the request would carry (salted blocks are keyed apart)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := requirePool(fs, *pool); err != nil {
		return err
	}
	if n := countSet(*promptFile, *tokensFile, *chatFile); n != 1 {
		fs.Usage()
		return fmt.Errorf("%w: give exactly one of --prompt-file, --chat-file and --tokens", errUsage)
	}
	c, err := o.client()
	if err != nil {
		return err
	}

	body := map[string]any{}
	if *adapter != "" {
		body["adapter"] = *adapter
	}
	if *cacheSalt != "" {
		body["cache_salt"] = *cacheSalt
	}
	if *tokensFile != "" {
		b, err := readInput(*tokensFile, os.Stdin)
		if err != nil {
			return err
		}
		ids, err := parseTokenIDs(b)
		if err != nil {
			return fmt.Errorf("%w: --tokens %s: %v", errUsage, *tokensFile, err)
		}
		body["token_ids"] = ids
	} else if *chatFile != "" {
		b, err := readInput(*chatFile, os.Stdin)
		if err != nil {
			return err
		}
		msgs, err := chatMessages(b)
		if err != nil {
			return fmt.Errorf("%w: --chat-file %s: %v", errUsage, *chatFile, err)
		}
		body["messages"] = msgs
	} else {
		b, err := readInput(*promptFile, os.Stdin)
		if err != nil {
			return err
		}
		if len(b) == 0 {
			return fmt.Errorf("%w: --prompt-file %s is empty", errUsage, *promptFile)
		}
		body["prompt"] = string(b)
	}

	var ans lookupAnswer
	raw, err := c.callJSON(ctx, "POST", poolPath(*pool, "lookup"), body, &ans)
	if err != nil {
		return err
	}
	if o.json {
		return writeIndented(stdout, raw)
	}
	return writeLookupTable(stdout, ans)
}

// countSet counts the non-empty strings.
func countSet(ss ...string) int {
	n := 0
	for _, s := range ss {
		if s != "" {
			n++
		}
	}
	return n
}

// chatMessages takes a JSON array of chat messages, or a chat request
// object holding one under "messages", and returns the array as it is.
func chatMessages(b []byte) (json.RawMessage, error) {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '{' {
		var req struct {
			Messages json.RawMessage `json:"messages"`
		}
		if err := json.Unmarshal(b, &req); err != nil {
			return nil, err
		}
		b = req.Messages
	}
	var msgs []json.RawMessage
	if err := json.Unmarshal(b, &msgs); err != nil {
		return nil, fmt.Errorf("want a JSON array of messages or a request with \"messages\": %v", err)
	}
	if len(msgs) == 0 {
		return nil, errors.New("no messages")
	}
	return json.RawMessage(b), nil
}

// readInput reads a whole file, or stdin for "-", bounded by maxLookupFile.
func readInput(name string, stdin io.Reader) ([]byte, error) {
	var r io.Reader = stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	b, err := io.ReadAll(io.LimitReader(r, maxLookupFile+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if len(b) > maxLookupFile {
		return nil, fmt.Errorf("%w: %s is larger than %d bytes", errUsage, name, maxLookupFile)
	}
	return b, nil
}

// errNoTokens is returned by parseTokenIDs for an input without any id.
var errNoTokens = errors.New("no token ids")

// parseTokenIDs reads token ids as a JSON array of integers, or as decimal
// integers separated by whitespace and/or commas (what 'cut', 'jq -r' and
// Python's print produce). Ids are uint32, as vLLM's token_ids are.
func parseTokenIDs(b []byte) ([]uint32, error) {
	t := bytes.TrimSpace(b)
	var fields [][]byte
	what := "token"
	if len(t) > 0 && t[0] == '[' {
		// Raw elements, not json.Number: that would also take "1" (a string).
		var nums []json.RawMessage
		dec := json.NewDecoder(bytes.NewReader(t))
		if err := dec.Decode(&nums); err != nil {
			return nil, fmt.Errorf("not a JSON array of integers: %w", err)
		}
		if dec.More() {
			return nil, errors.New("data after the JSON array")
		}
		for _, n := range nums {
			fields = append(fields, n)
		}
		what = "element"
	} else {
		fields = bytes.FieldsFunc(t, func(r rune) bool { return unicode.IsSpace(r) || r == ',' })
	}
	ids := make([]uint32, 0, len(fields))
	for i, f := range fields {
		id, err := tokenID(string(f))
		if err != nil {
			return nil, fmt.Errorf("%s %d: %w", what, i, err)
		}
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		return nil, errNoTokens
	}
	return ids, nil
}

func tokenID(s string) (uint32, error) {
	v, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		if len(s) > 40 {
			s = s[:40] + "…"
		}
		return 0, fmt.Errorf("%q is not a token id (an integer 0..%d)", s, uint32(math.MaxUint32))
	}
	return uint32(v), nil
}

func writeLookupTable(w io.Writer, ans lookupAnswer) error {
	fmt.Fprintf(w, "pool %s: prompt %d tokens, block size %d, %d full blocks\n", ans.Pool, ans.PromptTokens, ans.BlockSize, ans.Blocks)
	if ans.BlockSize == 0 {
		fmt.Fprintln(w, "the pool's block size is not known yet (no event has carried it): nothing can be held")
		return nil
	}
	if len(ans.Matches) == 0 {
		fmt.Fprintln(w, "no instance holds the prompt's first block")
		return nil
	}
	// In the router's order: longest held prefix first.
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "INSTANCE\tLIVE\tGPU\tCPU\tDISK\tSHARED\tTOTAL\tTOKENS\tOF-PROMPT")
	for _, m := range ans.Matches {
		live := "yes"
		if !m.Live {
			live = "STALE"
		}
		share := "-"
		if ans.Blocks > 0 {
			share = fmt.Sprintf("%.0f%%", 100*float64(matchTotal(m))/float64(ans.Blocks))
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", m.Instance, live, m.GPUBlocks, m.CPUBlocks, m.DiskBlocks, m.SharedBlocks, matchTotal(m), matchTotal(m)*ans.BlockSize, share)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "(blocks held as a contiguous prefix; each tier counts blocks beyond the faster tiers)")
	return nil
}
