package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/kvrouter/kvrouter/workload"
)

// runSynth writes a trace drawn from --trace's fitted profile, moved by a
// named shape, as Mooncake-format JSON lines (and prints its statistics).
func runSynth(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("synth", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench synth --shape S [--trace FILE] [--out FILE]", "Writes a trace synthesised from a trace's fitted shape (prefix tree, lengths, bursts, turn\norder), so a rule can be tried on traffic it was not developed against (docs/kvbench.md).", []string{"kvbench synth --shape calibrated --out synth.jsonl.gz"})
	names := make([]string, 0, len(workload.SynthShapes))
	for k := range workload.SynthShapes {
		names = append(names, k)
	}
	sort.Strings(names)
	trace := fs.String("trace", workload.DefaultTracePath, "trace to calibrate to (Mooncake format, plain or gzip)")
	shape := fs.String("shape", "calibrated", "shape: "+strings.Join(names, ", ")+", or one of --synth-shapes")
	shapesFile := fs.String("synth-shapes", "", synthShapesUsage)
	n := fs.Int("requests", 0, "requests to draw (0 = as many as the trace)")
	seed := fs.Uint64("seed", 1, "seed (same seed, same trace)")
	out := fs.String("out", "", "file to write the trace to (JSON lines; required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" {
		return fmt.Errorf("--out is required")
	}
	shapes, err := readSynthShapes(*shapesFile)
	if err != nil {
		return err
	}
	recs, err := workload.OpenTrace(*trace)
	if err != nil {
		return err
	}
	syn, err := workload.Synthesise(recs, *shape, shapes, *n, *seed)
	if err != nil {
		return err
	}
	f, err := os.Create(*out)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	enc := json.NewEncoder(bw)
	for i := range syn {
		if err := enc.Encode(&syn[i]); err != nil {
			f.Close()
			return err
		}
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	st := workload.Stats(syn)
	fmt.Fprintf(stdout, "%s: %d requests over %.0f s (%.2f req/s), input mean %.0f median %.0f p90 %.0f; infinite-cache hit %.3f\n",
		*out, st.Requests, st.DurationSec, st.RatePerSec, st.InputMean, st.InputMedian, st.InputP90, workload.InfiniteBound(syn).TokenRatio())
	return nil
}
