// Command kvctl is the operator CLI for kvrouter: it inspects what engines
// send (KV-event captures) and, as commands are added, what the router knows.
//
// Usage:
//
//	kvctl <command> [subcommand] [flags] [args]
//	kvctl --help
//	kvctl <command> --help
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/kvrouter/kvrouter/internal/version"
)

// command is one entry of the static command table. name may have several
// words ("events decode"); the longest name matching the leading arguments
// runs, with the remaining arguments.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout io.Writer) error
}

// commands is the whole CLI; adding a command is adding one line.
var commands = []command{
	{"decide", "ask where the router would send a request now and why: kv_aware's pick beside the hash's (dry, nothing routed)", runDecide},
	{"events decode", "print a KV-event capture (raw msgpack payload or JSONL with payload_b64; - for stdin) as one JSON object per event", runEventsDecode},
	{"instances", "list pools' instances: health, in-flight, KV blocks per tier, event stream state", runInstances},
	{"lookup", "ask a pool's KV index which instances hold a prompt's blocks, per tier", runLookup},
	{"queue", "show pools' flow-control queues: waiting requests, budgets, admitted and shed, bands and tenants", runQueue},
	{"routing get", "show the routing in force (strategy, prefix length, concurrency threshold)", runRoutingGet},
	{"routing set", "change a pool's routing at runtime", runRoutingSet},
	{"tail evictions", "follow a pool's KV evictions (router SSE stream, or NATS with --nats)", runTailEvictions},
	{"tokenize", "tokenize JSON lines (text, or messages + add_generation_prompt) with a model's tokenizer files and print them back with ids (and rendered chats)", runTokenize},
}

// errUsage marks an error caused by how kvctl was called (exit status 2).
var errUsage = errors.New("usage")

func main() {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().String("kvctl"))
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run dispatches args and returns the process exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || isHelp(args[0]) || args[0] == "help" {
		usage(stdout, commands, "")
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	cmd, rest := lookup(commands, args)
	if cmd == nil {
		cmd, rest = lookupAfterFlags(commands, args)
	}
	if cmd == nil {
		// A group name alone ("kvctl events") or with --help lists its commands.
		prefix := strings.Join(leadingWords(args), " ")
		if group := matching(commands, prefix); len(group) > 0 {
			usage(stdout, group, prefix)
			if len(args) > len(strings.Fields(prefix)) && isHelp(args[len(strings.Fields(prefix))]) {
				return 0
			}
			return 2
		}
		fmt.Fprintf(stderr, "kvctl: unknown command %q (see kvctl --help)\n", strings.Join(args, " "))
		return 2
	}
	if err := cmd.run(ctx, rest, stdout); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "kvctl %s: %v\n", cmd.name, err)
		if errors.Is(err, errUsage) {
			return 2
		}
		return 1
	}
	return 0
}

func isHelp(a string) bool { return a == "-h" || a == "-help" || a == "--help" }

// leadingWords are the arguments before the first flag.
func leadingWords(args []string) []string {
	for i, a := range args {
		if strings.HasPrefix(a, "-") {
			return args[:i]
		}
	}
	return args
}

// lookup finds the command with the longest name that prefixes args.
func lookup(cmds []command, args []string) (*command, []string) {
	var best *command
	bestLen := 0
	for i := range cmds {
		words := strings.Fields(cmds[i].name)
		if len(words) <= len(args) && len(words) > bestLen && equalWords(words, args[:len(words)]) {
			best, bestLen = &cmds[i], len(words)
		}
	}
	if best == nil {
		return nil, nil
	}
	return best, args[bestLen:]
}

// lookupAfterFlags finds a command named after leading flags ("kvctl --router URL
// instances", as many CLIs allow) and hands those flags to it, before its own arguments.
func lookupAfterFlags(cmds []command, args []string) (*command, []string) {
	if len(args) == 0 || !strings.HasPrefix(args[0], "-") {
		return nil, nil
	}
	for i := 1; i < len(args); i++ {
		if strings.HasPrefix(args[i], "-") {
			continue
		}
		if cmd, rest := lookup(cmds, args[i:]); cmd != nil {
			return cmd, append(append([]string(nil), args[:i]...), rest...)
		}
	}
	return nil, nil
}

func equalWords(a, b []string) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// matching lists the commands under a group prefix ("events").
func matching(cmds []command, prefix string) []command {
	var out []command
	for _, c := range cmds {
		if prefix != "" && strings.HasPrefix(c.name+" ", prefix+" ") {
			out = append(out, c)
		}
	}
	return out
}

func usage(w io.Writer, cmds []command, prefix string) {
	if prefix == "" {
		fmt.Fprintln(w, "kvctl — operator CLI for kvrouter")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "Usage: kvctl <command> [flags] [args]")
	} else {
		fmt.Fprintf(w, "Usage: kvctl %s <subcommand> [flags] [args]\n", prefix)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	sorted := append([]command(nil), cmds...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].name < sorted[j].name })
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	for _, c := range sorted {
		fmt.Fprintf(tw, "  %s\t%s\n", c.name, c.summary)
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'kvctl <command> --help' for a command's flags.")
}
