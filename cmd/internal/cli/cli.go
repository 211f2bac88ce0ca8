// Package cli is what the binaries share at the edge of the process:
// kvbench's, kvbridge's and kvsim's main (--version, signals, exit status)
// and the logger their --log-level names, and every binary's --help layout. It holds no state; each binary's run stays a
// function of its arguments, which its tests call.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvrouter/kvrouter/internal/version"
)

// Main runs run as the process named name. --version prints the build and
// exits; SIGINT and SIGTERM cancel run's context; flag.ErrHelp (help was
// asked for and printed) is success; any other error is printed as
// "name: error" and exits with failCode.
func Main(name string, failCode int, run func(ctx context.Context, args []string) error) {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().String(name))
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(failCode)
	}
}

// SetUsage makes fs's --help print head on w, fs's flags (on fs's output,
// which each binary sets to w too), then foot on w: the shape of every
// binary's help (what it does and how it is called, the flags, then
// anything that follows them).
func SetUsage(fs *flag.FlagSet, w io.Writer, head, foot string) {
	fs.Usage = func() {
		fmt.Fprint(w, head)
		fs.PrintDefaults()
		fmt.Fprint(w, foot)
	}
}

// Logger is a text logger on w at a --log-level value (debug, info, warn,
// error, or an offset such as info+2).
func Logger(w io.Writer, level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}
