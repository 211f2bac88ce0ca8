package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/router/flowcontrol"
)

// queueStatus is GET /admin/pools/{pool}/queue.
type queueStatus struct {
	Pool    string             `json:"pool"`
	Enabled bool               `json:"enabled"`
	Queue   *flowcontrol.Stats `json:"queue,omitempty"`
}

func runQueue(ctx context.Context, args []string, stdout io.Writer) error {
	var o adminOpts
	fs := adminFlagSet("queue", stdout, &o, `Usage: kvctl queue [--pool P]

Shows the flow-control queue of every pool, or of one with its priority
bands and the tenants with the most queued tokens
(GET /admin/pools/{pool}/queue): requests waiting and their tokens, the
oldest wait, in flight against the budget, pending prefill, and what was
admitted and shed (by reason) since the queue was made. --json prints the
router's answer (an array of them without --pool).

Flags:`)
	pool := fs.String("pool", "", "pool to show, with its priority bands and busiest tenants (default: a line per pool)")
	c, err := o.parseClient(fs, args)
	if err != nil {
		return err
	}
	names := []string{*pool}
	if *pool == "" {
		var pools []struct {
			Name string `json:"name"`
		}
		if _, err := c.callJSON(ctx, "GET", "/admin/pools", nil, &pools); err != nil {
			return err
		}
		names = names[:0]
		for _, p := range pools {
			names = append(names, p.Name)
		}
	}
	var all []queueStatus
	for _, n := range names {
		var qs queueStatus
		if _, err := c.callJSON(ctx, "GET", poolPath(n, "queue"), nil, &qs); err != nil {
			return err
		}
		all = append(all, qs)
	}
	if o.json {
		if *pool != "" {
			return writeJSONValue(stdout, all[0])
		}
		return writeJSONValue(stdout, all)
	}
	if err := writeQueueTable(stdout, all); err != nil {
		return err
	}
	if *pool != "" && all[0].Queue != nil {
		return writeQueueDetail(stdout, all[0].Queue)
	}
	return nil
}

func writeQueueTable(w io.Writer, all []queueStatus) error {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tFLOW-CONTROL\tQUEUED\tTOKENS\tOLDEST\tIN-FLIGHT\tPENDING-PREFILL\tADMITTED\tSHED")
	for _, qs := range all {
		q := qs.Queue
		if !qs.Enabled || q == nil {
			fmt.Fprintf(tw, "%s\toff\t-\t-\t-\t-\t-\t-\t-\n", qs.Pool)
			continue
		}
		fmt.Fprintf(tw, "%s\ton\t%d/%d\t%d\t%s\t%d/%s\t%s\t%d now, %d queued\t%s\n", qs.Pool,
			q.Queued, q.MaxQueue, q.QueuedTokens, q.OldestWait.Round(time.Millisecond),
			q.InFlight, limit(int64(q.MaxConcurrency)), pendingCell(q),
			q.Counts.AdmittedAtOnce, q.Counts.AdmittedQueued, shedLine(q.Counts.Shed))
	}
	return tw.Flush()
}

func writeQueueDetail(w io.Writer, q *flowcontrol.Stats) error {
	fmt.Fprintf(w, "\ndrain %.0f tokens/s, service TTFT %s\n\n", q.DrainTokensPerSec, q.ServiceTTFT.Round(time.Millisecond))
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "PRIORITY\tQUEUED\tTOKENS\tOLDEST")
	for _, b := range q.Bands {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\n", b.Priority, b.Queued, b.Tokens, b.OldestWait.Round(time.Millisecond))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tQUEUED\tTOKENS\tORDER")
	for _, t := range q.Tenants {
		name := t.Tenant
		if name == "" {
			name = "(none)"
		}
		order := "oldest first"
		if t.NewestFirst {
			order = "newest first"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", name, t.Queued, t.Tokens, order)
	}
	return tw.Flush()
}

// pendingCell is the pool's admitted prompt tokens not yet answered with
// a first byte, over its bound: the pool's, or, with only
// prefill_tokens_per_instance set, the bound per instance.
func pendingCell(q *flowcontrol.Stats) string {
	if q.MaxPendingPrefill <= 0 && q.InstancePrefill > 0 {
		return fmt.Sprintf("%d/%d per instance", q.PendingPrefill, q.InstancePrefill)
	}
	return fmt.Sprintf("%d/%s", q.PendingPrefill, limit(q.MaxPendingPrefill))
}

func limit(n int64) string {
	if n <= 0 {
		return "none"
	}
	return fmt.Sprint(n)
}

func shedLine(by map[flowcontrol.Reason]uint64) string {
	var parts []string
	for _, r := range slices.Sorted(maps.Keys(by)) {
		if by[r] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", r, by[r]))
		}
	}
	if len(parts) == 0 {
		return "0"
	}
	return strings.Join(parts, ", ")
}
