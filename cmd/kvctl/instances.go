package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/tiers"
)

// poolStatus is one pool of GET /admin/pools (router.PoolStatus).
type poolStatus struct {
	Name      string           `json:"name"`
	Model     string           `json:"model"`
	Routing   routingView      `json:"routing"`
	Instances []instanceStatus `json:"instances"`
}

// instanceStatus is one instance of router.PoolStatus.
type instanceStatus struct {
	ID       string   `json:"id"`
	URL      string   `json:"url"`
	Healthy  bool     `json:"healthy"`
	InFlight int      `json:"in_flight"`
	Adapters []string `json:"adapters"`
}

// kvInstance is one instance of GET /admin/pools/{pool}/instances: what the
// pool's KV index and event consumer know of it (issue 4: blocks per tier,
// last event time, last seq, gaps, state).
type kvInstance struct {
	Instance  string
	State     string
	Blocks    map[string]int // by tiers.Tier.String()
	LastEvent *time.Time
	LastSeq   *uint64
	Gaps      *uint64
	raw       map[string]any // the router's whole record, for --json
}

// instanceRow is what kvctl prints per instance: the router's view
// (health, in-flight) joined with the KV view when the router has one.
type instanceRow struct {
	Pool      string         `json:"pool"`
	Instance  string         `json:"instance"`
	URL       string         `json:"url,omitempty"`
	Healthy   *bool          `json:"healthy,omitempty"`
	InFlight  *int           `json:"in_flight,omitempty"`
	Adapters  []string       `json:"adapters,omitempty"`
	State     string         `json:"state,omitempty"`
	Blocks    map[string]int `json:"blocks,omitempty"`
	LastEvent *time.Time     `json:"last_event,omitempty"`
	LastSeq   *uint64        `json:"last_seq,omitempty"`
	Gaps      *uint64        `json:"gaps,omitempty"`
	// KV is the router's whole KV record of the instance (--json only).
	KV map[string]any `json:"kv,omitempty"`
}

func runInstances(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("instances", flag.ContinueOnError)
	fs.SetOutput(stdout)
	var o adminOpts
	addAdminFlags(fs, &o)
	pool := fs.String("pool", "", "only this pool (default: every pool)")
	fs.Usage = func() {
		fmt.Fprintln(stdout, `Usage: kvctl instances [--pool P]

Lists each pool's instances: health and in-flight requests (GET /admin/pools),
joined with what the pool's KV index and event stream know of them
(GET /admin/pools/{pool}/instances): state (live, stale, purged), blocks per
tier, last event time, last seq and gaps. Instances known only from events
(heartbeat discovery) are listed too. Pools without a KV index show '-'.
--json prints one array of rows, each with the router's whole KV record
under "kv".

Flags:`)
		fs.PrintDefaults()
		fmt.Fprintln(stdout, "\n"+adminFlagsHelp)
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	c, err := o.client()
	if err != nil {
		return err
	}
	var pools []poolStatus
	if *pool != "" {
		var p poolStatus
		if _, err := c.callJSON(ctx, "GET", poolPath(*pool, ""), nil, &p); err != nil {
			return err
		}
		pools = []poolStatus{p}
	} else if _, err := c.callJSON(ctx, "GET", "/admin/pools", nil, &pools); err != nil {
		return err
	}
	var rows []instanceRow
	for _, p := range pools {
		kv, err := fetchKVInstances(ctx, c, p.Name)
		if err != nil {
			return err
		}
		rows = append(rows, joinInstances(p, kv)...)
	}
	if o.json {
		if rows == nil {
			rows = []instanceRow{}
		}
		return writeJSONValue(stdout, rows)
	}
	return writeInstancesTable(stdout, rows)
}

// fetchKVInstances asks for a pool's KV view; nil (no error) when the pool
// has no KV index or the router has no such endpoint, so that kvctl still
// lists health and load.
func fetchKVInstances(ctx context.Context, c *adminClient, pool string) ([]kvInstance, error) {
	b, err := c.call(ctx, "GET", poolPath(pool, "instances"), nil)
	var he *httpError
	if errors.As(err, &he) && (he.Status == http.StatusNotFound || he.Status == http.StatusConflict || he.Status == http.StatusNotImplemented) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	kv, err := decodeKVInstances(b)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", poolPath(pool, "instances"), err)
	}
	return kv, nil
}

// decodeKVInstances reads the instances answer: an array of instance
// records, or an object holding one under "instances". Each record names
// its instance ("instance" or "id") and gives blocks per tier as an object
// {"gpu": n, ...}, an array in tier order, or gpu_blocks-style fields.
func decodeKVInstances(b []byte) ([]kvInstance, error) {
	var list []map[string]any
	if err := json.Unmarshal(b, &list); err != nil {
		var wrap struct {
			Instances []map[string]any `json:"instances"`
		}
		if err2 := json.Unmarshal(b, &wrap); err2 != nil {
			return nil, fmt.Errorf("answer is not a list of instances: %w", err)
		}
		list = wrap.Instances
	}
	out := make([]kvInstance, 0, len(list))
	for _, m := range list {
		var ki kvInstance
		ki.raw = m
		ki.Instance = str(m["instance"])
		if ki.Instance == "" {
			ki.Instance = str(m["id"])
		}
		if ki.Instance == "" {
			continue
		}
		ki.State = str(m["state"])
		ki.Blocks = blocksOf(m)
		if t, err := time.Parse(time.RFC3339Nano, str(m["last_event"])); err == nil && !t.IsZero() {
			ki.LastEvent = &t
		}
		ki.LastSeq = uintOf(m["last_seq"])
		ki.Gaps = uintOf(m["gaps"])
		out = append(out, ki)
	}
	return out, nil
}

func str(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
	return ""
}

func uintOf(v any) *uint64 {
	if f, ok := v.(float64); ok && f >= 0 {
		u := uint64(f)
		return &u
	}
	return nil
}

// blocksOf finds an instance's blocks per tier, keyed by tiers' names.
func blocksOf(m map[string]any) map[string]int {
	out := map[string]int{}
	switch b := m["blocks"].(type) {
	case map[string]any:
		for k, v := range b {
			if t, ok := tiers.Parse(k); ok {
				if f, ok := v.(float64); ok {
					out[t.String()] = int(f)
				}
			}
		}
	case []any:
		for i, v := range b {
			if f, ok := v.(float64); ok && i < tiers.Count {
				out[tiers.Tier(i).String()] = int(f)
			}
		}
	}
	for t := range tiers.Tier(tiers.Count) {
		if f, ok := m[t.String()+"_blocks"].(float64); ok {
			out[t.String()] = int(f)
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// joinInstances merges a pool's configured instances with its KV records,
// configured ones first in config order, then those known only from events.
func joinInstances(p poolStatus, kv []kvInstance) []instanceRow {
	byID := make(map[string]*kvInstance, len(kv))
	for i := range kv {
		byID[kv[i].Instance] = &kv[i]
	}
	fill := func(r *instanceRow, k *kvInstance) {
		r.State, r.Blocks, r.LastEvent, r.LastSeq, r.Gaps, r.KV = k.State, k.Blocks, k.LastEvent, k.LastSeq, k.Gaps, k.raw
	}
	var rows []instanceRow
	seen := map[string]bool{}
	for _, in := range p.Instances {
		r := instanceRow{Pool: p.Name, Instance: in.ID, URL: in.URL, Healthy: &in.Healthy, InFlight: &in.InFlight, Adapters: in.Adapters}
		if k := byID[in.ID]; k != nil {
			fill(&r, k)
		}
		seen[in.ID] = true
		rows = append(rows, r)
	}
	for i := range kv {
		if seen[kv[i].Instance] {
			continue
		}
		r := instanceRow{Pool: p.Name, Instance: kv[i].Instance}
		if u := str(kv[i].raw["url"]); u != "" {
			r.URL = u
		}
		fill(&r, &kv[i])
		rows = append(rows, r)
	}
	return rows
}

func writeInstancesTable(w io.Writer, rows []instanceRow) error {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no instances")
		return nil
	}
	now := time.Now()
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tINSTANCE\tURL\tHEALTHY\tIN-FLIGHT\tSTATE\tGPU\tCPU\tDISK\tSHARED\tLAST-EVENT\tLAST-SEQ\tGAPS")
	for _, r := range rows {
		cells := []string{r.Pool, r.Instance, dash(r.URL), boolCell(r.Healthy), intCell(r.InFlight), dash(r.State)}
		for t := range tiers.Tier(tiers.Count) {
			if r.Blocks == nil {
				cells = append(cells, "-")
			} else {
				cells = append(cells, strconv.Itoa(r.Blocks[t.String()]))
			}
		}
		cells = append(cells, ago(r.LastEvent, now), uintCell(r.LastSeq), uintCell(r.Gaps))
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	return tw.Flush()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func boolCell(b *bool) string {
	switch {
	case b == nil:
		return "-"
	case *b:
		return "yes"
	}
	return "NO"
}

func intCell(v *int) string {
	if v == nil {
		return "-"
	}
	return strconv.Itoa(*v)
}

func uintCell(v *uint64) string {
	if v == nil {
		return "-"
	}
	return strconv.FormatUint(*v, 10)
}

// ago shows a time as an age, the way an operator reads staleness.
func ago(t *time.Time, now time.Time) string {
	if t == nil {
		return "-"
	}
	d := now.Sub(*t)
	if d < 0 {
		d = 0
	}
	switch {
	case d < time.Second:
		return "now"
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d.Hours()))
	}
	return t.UTC().Format("2006-01-02")
}
