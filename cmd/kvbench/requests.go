package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"strconv"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
)

// requestsHeader names the columns of requests-<strategy>.csv.
var requestsHeader = []string{"id", "arrival_ms", "instance", "reason", "overflow", "prompt_tokens",
	"cached_tokens", "output_tokens", "ttft_ms", "queued_ms", "finish_ms", "error"}

// writeRequestsCSV writes one row per request of res, in arrival order:
// where each went, why, what it found cached and its TTFT (virtual time),
// so a percentile in the summary can be traced to the requests behind it.
func writeRequestsCSV(path string, res *des.Result) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	werr := w.Write(requestsHeader)
	ms := func(d interface{ Microseconds() int64 }) string {
		return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 3, 64)
	}
	for _, o := range res.Outcomes {
		if werr != nil {
			break
		}
		werr = w.Write([]string{strconv.Itoa(o.ID), ms(o.Arrival), o.Instance, o.Reason, strconv.FormatBool(o.Overflow),
			strconv.Itoa(o.PromptTokens), strconv.Itoa(o.CachedTokens), strconv.Itoa(o.OutputTokens),
			ms(o.TTFT), ms(o.Queued), ms(o.Finish), o.Err})
	}
	if werr == nil {
		w.Flush()
		werr = w.Error()
	}
	if cerr := f.Close(); werr == nil && cerr != nil {
		werr = cerr
	}
	if werr != nil {
		return fmt.Errorf("%s: %w", path, werr)
	}
	return nil
}
