package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/router/admin/adminapi"
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

// kvInstances is GET /admin/pools/{pool}/instances: what the pool's KV
// index and event consumer know of each instance (blocks per tier, last
// event time, last seq, gaps, state), decoded into the server's own types.
type (
	kvInstances = adminapi.KVInstancesResponse
	kvInstance  = adminapi.KVInstanceView
)

// instanceRow is what kvctl prints per instance: the router's view
// (health, in-flight) joined with the KV view when the pool has one.
type instanceRow struct {
	Pool     string   `json:"pool"`
	Instance string   `json:"instance"`
	URL      string   `json:"url,omitempty"`
	Healthy  *bool    `json:"healthy,omitempty"`
	InFlight *int     `json:"in_flight,omitempty"`
	Adapters []string `json:"adapters,omitempty"`
	// KV is nil when the pool has no KV index.
	KV *kvInstance `json:"kv,omitempty"`
}

// poolKV is a pool's stream summary, printed under the table.
type poolKV struct {
	pool string
	kv   *kvInstances // nil: no KV index
}

func runInstances(ctx context.Context, args []string, stdout io.Writer) error {
	var o adminOpts
	fs := adminFlagSet("instances", stdout, &o, `Usage: kvctl instances [--pool P]

Lists each pool's instances: health and in-flight requests (GET /admin/pools),
joined with what the pool's KV index and event stream know of them
(GET /admin/pools/{pool}/instances): state (live, stale, purged; when not
live, why: engine_down, hole, reloading, index_unsynced, silent), blocks per
tier, last event time, last seq and gaps. Instances known only from events
(heartbeat discovery) are listed too. Pools without a KV index show '-'.
--json prints one array of rows, each with the router's whole KV record
under "kv".

Flags:`)
	pool := fs.String("pool", "", "only this pool (default: every pool)")
	c, err := o.parseClient(fs, args)
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
	var sums []poolKV
	for _, p := range pools {
		kv, err := fetchKVInstances(ctx, c, p.Name)
		if err != nil {
			return err
		}
		rows = append(rows, joinInstances(p, kv)...)
		sums = append(sums, poolKV{p.Name, kv})
	}
	if o.json {
		if rows == nil {
			rows = []instanceRow{}
		}
		return writeJSONValue(stdout, rows)
	}
	return writeInstancesTable(stdout, rows, sums, time.Now())
}

// fetchKVInstances asks for a pool's KV view; nil (no error) when the pool
// has no KV index (409) or the router has no such endpoint (404), so that
// kvctl still lists health and load.
func fetchKVInstances(ctx context.Context, c *adminClient, pool string) (*kvInstances, error) {
	var kv kvInstances
	_, err := c.callJSON(ctx, "GET", poolPath(pool, "instances"), nil, &kv)
	var he *httpError
	if errors.As(err, &he) && (he.Status == http.StatusNotFound || he.Status == http.StatusConflict) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &kv, nil
}

// joinInstances merges a pool's instances with its KV records: the pool's
// first in its order, then those known only from events.
func joinInstances(p poolStatus, kv *kvInstances) []instanceRow {
	byID := map[string]*kvInstance{}
	if kv != nil {
		for i := range kv.Instances {
			byID[kv.Instances[i].Instance] = &kv.Instances[i]
		}
	}
	var rows []instanceRow
	seen := map[string]bool{}
	for _, in := range p.Instances {
		r := instanceRow{Pool: p.Name, Instance: in.ID, URL: in.URL, Healthy: &in.Healthy, InFlight: &in.InFlight, Adapters: in.Adapters, KV: byID[in.ID]}
		if kv != nil && r.KV == nil {
			// The index and the consumer know nothing of it yet.
			r.KV = &kvInstance{Instance: in.ID, State: "unknown"}
		}
		seen[in.ID] = true
		rows = append(rows, r)
	}
	if kv != nil {
		for i := range kv.Instances {
			k := &kv.Instances[i]
			if !seen[k.Instance] {
				rows = append(rows, instanceRow{Pool: p.Name, Instance: k.Instance, URL: k.URL, KV: k})
			}
		}
	}
	return rows
}

func writeInstancesTable(w io.Writer, rows []instanceRow, sums []poolKV, now time.Time) error {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no instances")
		return nil
	}
	unread := map[string]bool{} // pools whose index did not answer
	for _, s := range sums {
		unread[s.pool] = s.kv != nil && s.kv.IndexError != ""
	}
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tINSTANCE\tURL\tHEALTHY\tIN-FLIGHT\tSTATE\tGPU\tCPU\tDISK\tSHARED\tLAST-EVENT\tLAST-SEQ\tGAPS")
	for _, r := range rows {
		cells := []string{r.Pool, r.Instance, dash(r.URL), boolCell(r.Healthy), intCell(r.InFlight)}
		if k := r.KV; k != nil {
			cells = append(cells, stateCell(k))
			for t := range tiers.Tier(tiers.Count) {
				if unread[r.Pool] {
					cells = append(cells, "?") // the index not read (see the pool's line)
				} else {
					cells = append(cells, strconv.Itoa(k.Blocks[t.String()]))
				}
			}
			cells = append(cells, ago(k.LastEvent, now), strconv.FormatUint(k.LastSeq, 10), strconv.FormatUint(k.Gaps, 10))
		} else {
			cells = append(cells, "-", "-", "-", "-", "-", "-", "-", "-")
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, s := range sums {
		switch {
		case s.kv == nil:
			fmt.Fprintf(w, "pool %s: no KV index (events disabled, or a router without the KV admin API)\n", s.pool)
		case s.kv.StreamHealthy:
			fmt.Fprintf(w, "pool %s: event stream healthy, block size %d\n", s.pool, s.kv.BlockSize)
		default:
			fmt.Fprintf(w, "pool %s: event stream NOT healthy (kv_aware routes heuristically), block size %d\n", s.pool, s.kv.BlockSize)
		}
		if s.kv != nil && s.kv.IndexError != "" {
			fmt.Fprintf(w, "pool %s: blocks unknown (?): %s\n", s.pool, s.kv.IndexError)
		}
	}
	return nil
}

// stateCell is an instance's state with, when it is not live for
// kv_aware, why (the consumer's not_live): "stale (hole)", "stale
// (engine_down)"; the consumer's live with its shared-index state being
// repaired reads "stale (index_unsynced)".
func stateCell(k *kvInstance) string {
	if k.NotLive == "" && k.IndexUnsynced && k.State == "live" {
		return "stale (index_unsynced)" // a router that gives no reason
	}
	switch {
	case k.NotLive == "" || k.NotLive == k.State:
		return dash(k.State)
	case k.State == "live":
		return "stale (" + k.NotLive + ")"
	}
	return k.State + " (" + k.NotLive + ")"
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

// ago shows a time as an age, the way an operator reads staleness.
func ago(t time.Time, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := max(now.Sub(t), 0)
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
