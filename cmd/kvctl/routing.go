package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// routingView is the part of the router's routing block kvctl shows in a
// table; --json prints the router's whole answer.
type routingView struct {
	Strategy             string          `json:"strategy"`
	PrefixLength         int             `json:"prefix_length"`
	ConcurrencyThreshold int             `json:"concurrency_threshold"`
	Shadow               bool            `json:"shadow"`
	KV                   json.RawMessage `json:"kv,omitempty"`
}

// poolRouting is one pool of GET /admin/pools, as far as routing goes.
type poolRouting struct {
	Name    string      `json:"name"`
	Model   string      `json:"model"`
	Routing routingView `json:"routing"`
}

func runRoutingSet(ctx context.Context, args []string, stdout io.Writer) error {
	var o adminOpts
	fs := adminFlagSet("routing set", stdout, &o, `Usage: kvctl routing set --pool P [--strategy S] [--prefix-length N] [--concurrency-threshold N] [--shadow=true|false]

Changes a pool's routing at runtime (PUT /admin/pools/{pool}/routing). Only
the flags given are sent; the router keeps the other fields, validates the
result and answers with the routing now in force, which kvctl prints. The
change lasts until the router restarts or reloads its config (SIGHUP).

Example:
  kvctl routing set --pool llama --strategy kv_aware --concurrency-threshold 32

Flags:`)
	pool := fs.String("pool", "", "pool (model deployment) to change (required)")
	strategy := fs.String("strategy", "", "random | round_robin | least_outstanding | prefix_aware | kv_aware")
	prefixLen := fs.Int("prefix-length", 0, "routing text length, characters (OpenAI API) or bytes (raw invoke), 1024..65536")
	threshold := fs.Int("concurrency-threshold", 0, "in-flight requests at which an instance overflows, 1..1024")
	shadow := fs.Bool("shadow", false, "also score every request with the other strategy (needs the pool's KV index)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := requirePool(fs, *pool); err != nil {
		return err
	}
	// Only explicitly given flags go into the body: the router merges it
	// onto the current routing, so an absent field keeps its value.
	body := map[string]any{}
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "strategy":
			body["strategy"] = strings.TrimSpace(*strategy)
		case "prefix-length":
			body["prefix_length"] = *prefixLen
		case "concurrency-threshold":
			body["concurrency_threshold"] = *threshold
		case "shadow":
			body["shadow"] = *shadow
		}
	})
	if len(body) == 0 {
		fs.Usage()
		return fmt.Errorf("%w: nothing to change: give --strategy, --prefix-length, --concurrency-threshold or --shadow", errUsage)
	}
	if s, ok := body["strategy"].(string); ok && s == "" {
		return fmt.Errorf("%w: --strategy is empty", errUsage)
	}
	c, err := o.client()
	if err != nil {
		return err
	}
	return poolRoutingCall(ctx, c, "PUT", *pool, body, o.json, stdout)
}

// poolRoutingCall gets or sets one pool's routing and prints the routing
// the router answers with: as it sent it with --json, else as a table.
func poolRoutingCall(ctx context.Context, c *adminClient, method, pool string, body any, asJSON bool, stdout io.Writer) error {
	var rv routingView
	raw, err := c.callJSON(ctx, method, poolPath(pool, "routing"), body, &rv)
	if err != nil {
		return err
	}
	if asJSON {
		return writeIndented(stdout, raw)
	}
	return writeRoutingTable(stdout, []poolRouting{{Name: pool, Routing: rv}})
}

func runRoutingGet(ctx context.Context, args []string, stdout io.Writer) error {
	var o adminOpts
	fs := adminFlagSet("routing get", stdout, &o, `Usage: kvctl routing get [--pool P]

Shows the routing in force: for one pool (GET /admin/pools/{pool}/routing),
or for every pool (GET /admin/pools). --json prints the router's routing
block (one pool) or an array of {"pool", "model", "routing"} (every pool),
including the kv_aware scoring constants when set.

Flags:`)
	pool := fs.String("pool", "", "pool to show (default: every pool)")
	c, err := o.parseClient(fs, args)
	if err != nil {
		return err
	}
	if *pool != "" {
		return poolRoutingCall(ctx, c, "GET", *pool, nil, o.json, stdout)
	}
	var pools []poolRouting
	if _, err := c.callJSON(ctx, "GET", "/admin/pools", nil, &pools); err != nil {
		return err
	}
	if o.json {
		type out struct {
			Pool    string      `json:"pool"`
			Model   string      `json:"model"`
			Routing routingView `json:"routing"`
		}
		list := make([]out, 0, len(pools))
		for _, p := range pools {
			list = append(list, out{p.Name, p.Model, p.Routing})
		}
		return writeJSONValue(stdout, list)
	}
	return writeRoutingTable(stdout, pools)
}

func writeRoutingTable(w io.Writer, pools []poolRouting) error {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tSTRATEGY\tPREFIX-LENGTH\tCONCURRENCY-THRESHOLD\tSHADOW\tKV-SCORING")
	for _, p := range pools {
		r := p.Routing
		kv := "defaults"
		if len(r.KV) > 0 && string(r.KV) != "null" && string(r.KV) != "{}" {
			kv = "custom (--json)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%t\t%s\n", p.Name, r.Strategy, r.PrefixLength, r.ConcurrencyThreshold, r.Shadow, kv)
	}
	return tw.Flush()
}
