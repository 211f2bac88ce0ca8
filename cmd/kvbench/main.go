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
	"runtime/pprof"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
)

func main() {
	cli.Main("kvbench", 2, func(ctx context.Context, args []string) error {
		return run(ctx, args, os.Stdout, os.Stderr)
	})
}

// commands is the whole CLI, in the order "kvbench help" lists it.
var commands = []struct {
	name, summary string
	run           func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}{
	{"bounds", "hit-rate bounds of a Mooncake-format trace: pooled LRU caches and an infinite cache", runBounds},
	{"synth", "write a Mooncake-format trace synthesised from a trace's fitted shape", runSynth},
	{"des", "discrete-event comparison of strategies on simulated engines (virtual clock)", runDES},
	{"sweep", "des over strategies × loads × fleet sizes × workloads: one table and chart per workload", runSweep},
	{"flow", "des of overload bursts with and without flow control (priorities, tenants, TTFT objectives)", runFlow},
	{"indexer", "trace replay through the KV block index alone (lookups and engine events, interleaved)", runIndexer},
	{"disagg", "des: aggregated vs disaggregated prefill/decode (P:D ratios, conditional) on the same instances", runDisagg},
	{"live", "drive a running kvrouter (with kvsim engines) over HTTP", runLive},
	{"demo", "embedded NATS + simulated fleet + router; compares strategies; exits by itself", runDemo},
}

func usage(w io.Writer) {
	fmt.Fprint(w, "usage: kvbench <command> [flags]\n\ncommands:\n")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
}

// run is main without the process: tests call it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		usage(stderr)
		return errors.New("no command")
	}
	cmd, rest := args[0], args[1:]
	for _, c := range commands {
		if c.name == cmd {
			return c.run(ctx, rest, stdout, stderr)
		}
	}
	if cmd == "help" || cmd == "-h" || cmd == "--help" {
		usage(stdout)
		return nil
	}
	usage(stderr)
	return fmt.Errorf("unknown command %q", cmd)
}

// setUsage gives a command's -h what kvctl's and kvbridge's have: the
// synopsis, what the command does, examples, then the flags.
func setUsage(fs *flag.FlagSet, w io.Writer, synopsis, description string, examples []string) {
	head := fmt.Sprintf("usage: %s\n\n%s\n\nExamples:\n", synopsis, description)
	for _, e := range examples {
		head += fmt.Sprintf("  %s\n", e)
	}
	cli.SetUsage(fs, w, head+"\nFlags:\n", "")
}

// startCPUProfile starts a CPU profile into path (nothing when path is
// empty); stop ends it and closes the file.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
