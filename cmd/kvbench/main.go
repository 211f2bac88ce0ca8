// Command kvbench replays workloads through routing strategies and reports
// what each buys: KV hit rate, TTFT percentiles, throughput, balance,
// overflow and decision cost.
//
//	kvbench bounds   hit-rate bounds of a trace (pooled LRU cache, infinite cache)
//	kvbench synth    write a trace synthesised from a trace's fitted shape
//	kvbench des      discrete-event run: real strategies, simulated engines, virtual clock
//	kvbench sweep    des over strategies × loads × fleet sizes × workloads: a table and a chart per workload
//	kvbench flow     des of overload bursts with and without flow control
//	kvbench indexer  trace replay through the KV block index alone: ops/s, lookup and apply CPU time, heap
//	kvbench live     drive a running kvrouter over HTTP
//	kvbench demo     start a small fleet in-process and compare strategies
//
// Run "kvbench <command> -h" for a command's flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
)

func main() {
	cli.Main("kvbench", 2, func(ctx context.Context, args []string) error {
		return run(ctx, args, os.Stdout, os.Stderr)
	})
}

const usage = `usage: kvbench <command> [flags]

commands:
  bounds   hit-rate bounds of a Mooncake-format trace: pooled LRU caches and an infinite cache
  synth    write a Mooncake-format trace synthesised from a trace's fitted shape
  des      discrete-event comparison of strategies on simulated engines (virtual clock)
  sweep    des over strategies × loads × fleet sizes × workloads: one table and chart per workload
  flow     des of overload bursts with and without flow control (priorities, tenants, TTFT objectives)
  indexer  trace replay through the KV block index alone (lookups and engine events, interleaved)
  disagg   des: aggregated vs disaggregated prefill/decode (P:D ratios, conditional) on the same instances
  live     drive a running kvrouter (with kvsim engines) over HTTP
  demo     embedded NATS + simulated fleet + router; compares strategies; exits by itself
`

// run is main without the process: tests call it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command")
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "bounds":
		return runBounds(ctx, rest, stdout, stderr)
	case "synth":
		return runSynth(ctx, rest, stdout, stderr)
	case "sweep":
		return runSweep(ctx, rest, stdout, stderr)
	case "des":
		return runDES(ctx, rest, stdout, stderr)
	case "flow":
		return runFlow(ctx, rest, stdout, stderr)
	case "indexer":
		return runIndexer(ctx, rest, stdout, stderr)
	case "disagg":
		return runDisagg(ctx, rest, stdout, stderr)
	case "live":
		return runLive(ctx, rest, stdout, stderr)
	case "demo":
		return runDemo(ctx, rest, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", cmd)
}

// setUsage gives a command's -h what kvctl's and kvbridge's have: the
// synopsis, what the command does, examples, then the flags.
func setUsage(fs *flag.FlagSet, w io.Writer, synopsis, description string, examples []string) {
	fs.Usage = func() {
		fmt.Fprintf(w, "usage: %s\n\n%s\n\nExamples:\n", synopsis, description)
		for _, e := range examples {
			fmt.Fprintf(w, "  %s\n", e)
		}
		fmt.Fprintf(w, "\nFlags:\n")
		fs.PrintDefaults()
	}
}
