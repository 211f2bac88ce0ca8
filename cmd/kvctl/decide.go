package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/kvrouter/kvrouter/router/admin/adminapi"
)

func runDecide(ctx context.Context, args []string, stdout io.Writer) error {
	var o adminOpts
	fs := adminFlagSet("decide", stdout, &o, `Usage: kvctl decide --pool P (--request F | --prompt-file F | --chat-file F | --tokens F)

Asks the router where it would send a request now, and why
(POST /admin/pools/{pool}/decide): kv_aware's pick and prefix_aware's hash
pick, each with the prompt tokens that instance holds per tier and the time
to first token kv_aware predicts there. Nothing is routed and nothing is
committed: the answer changes no state, so it is safe to ask in production.
The request is resolved as the data plane resolves it (limits, the tenant
key from prompt_cache_key, the pool's cache salt). The pool must route with
kv_aware or shadow its strategy with it (routing.shadow).

--request takes a whole request body as a client sends it
(/v1/chat/completions when it has "messages", else /v1/completions); the
other inputs are wrapped into one.

Examples:
  kvctl decide --pool llama --request body.json
  kvctl decide --pool llama --prompt-file prompt.txt
  echo '128000 9906 1917' | kvctl decide --pool llama --tokens - --json

Flags:`)
	pool := fs.String("pool", "", "pool to ask (required)")
	reqFile := fs.String("request", "", "file holding a request body as a client sends it ('-' for stdin)")
	promptFile := fs.String("prompt-file", "", "file holding the prompt text ('-' for stdin), sent as a completion")
	chatFile := fs.String("chat-file", "", "file holding chat messages ('-' for stdin): a JSON array of {role, content}, or a chat request with \"messages\"")
	tokensFile := fs.String("tokens", "", "file of token ids, sent as a completion's prompt: a JSON array, or integers separated by whitespace or commas ('-' for stdin)")
	adapter := fs.String("adapter", "", "LoRA adapter the request names (its model); with --request, the body's model counts")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := requirePool(fs, *pool); err != nil {
		return err
	}
	if n := countSet(*reqFile, *promptFile, *chatFile, *tokensFile); n != 1 {
		fs.Usage()
		return fmt.Errorf("%w: give exactly one of --request, --prompt-file, --chat-file and --tokens", errUsage)
	}
	c, err := o.client()
	if err != nil {
		return err
	}
	body, err := decideBody(*reqFile, *promptFile, *chatFile, *tokensFile, *adapter)
	if err != nil {
		return err
	}
	var ans adminapi.DecideResponse
	raw, err := c.callJSON(ctx, "POST", poolPath(*pool, "decide"), body, &ans)
	if err != nil {
		return err
	}
	if o.json {
		return writeIndented(stdout, raw)
	}
	return writeDecideTable(stdout, ans)
}

// decideBody builds the request body from the one input given.
func decideBody(reqFile, promptFile, chatFile, tokensFile, adapter string) (json.RawMessage, error) {
	name, file := "--request", reqFile
	for _, f := range [][2]string{{"--prompt-file", promptFile}, {"--chat-file", chatFile}, {"--tokens", tokensFile}} {
		if f[1] != "" {
			name, file = f[0], f[1]
		}
	}
	b, err := readInput(file, os.Stdin)
	if err != nil {
		return nil, err
	}
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: %s %s is empty", errUsage, name, file)
	}
	body := map[string]any{}
	if adapter != "" {
		body["model"] = adapter
	}
	switch name {
	case "--request":
		if !json.Valid(b) {
			return nil, fmt.Errorf("%w: --request %s is not JSON", errUsage, file)
		}
		return json.RawMessage(b), nil
	case "--prompt-file":
		body["prompt"] = string(b)
	case "--chat-file":
		msgs, err := chatMessages(b)
		if err != nil {
			return nil, fmt.Errorf("%w: --chat-file %s: %v", errUsage, file, err)
		}
		body["messages"] = msgs
	default:
		ids, err := parseTokenIDs(b)
		if err != nil {
			return nil, fmt.Errorf("%w: --tokens %s: %v", errUsage, file, err)
		}
		body["prompt"] = ids
	}
	out, err := json.Marshal(body)
	return out, err
}

func writeDecideTable(w io.Writer, ans adminapi.DecideResponse) error {
	fmt.Fprintf(w, "pool %s (routes with %s), %s request, %d prompt tokens\n", ans.Pool, ans.Strategy, ans.Endpoint, max(ans.KVAware.PromptTokens, ans.PrefixAware.PromptTokens))
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "STRATEGY\tINSTANCE\tREASON\tGPU\tCPU\tDISK\tSHARED\tPREDICTED-TTFT")
	for _, p := range []struct {
		name string
		p    adminapi.DecidePick
	}{{"kv_aware", ans.KVAware}, {"prefix_aware", ans.PrefixAware}} {
		ttft := "-"
		if p.p.PredictedTTFTMs != nil {
			ttft = fmt.Sprintf("%.2f ms", *p.p.PredictedTTFTMs)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%s\n", p.name, p.p.Instance, p.p.Reason, p.p.GPUTokens, p.p.CPUTokens, p.p.DiskTokens, p.p.SharedTokens, ttft)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "(tokens of the prompt held there, each tier beyond the faster tiers; evaluated dry, nothing routed)")
	return nil
}
