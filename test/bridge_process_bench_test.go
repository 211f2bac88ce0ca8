package test

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// BenchmarkBridgeProcess measures kvbridge as deployed: the binary in its
// own process, the engine in another (vLLM publishes from Python through
// libzmq, not from the bridge's process) and a real nats-server in a third,
// so that the bridge's CPU is its own. The engine is eventstest.StreamPUB:
// the handshake by go-zeromq, then vLLM's [topic, seq, payload] messages as
// pre-encoded ZMTP frames written in large chunks, so the engine side costs
// little and the bridge, not its stand-in, is what is measured. b.N engine
// messages are written as fast as the connection takes them (a backlog: the
// bridge's input buffer holds all of them, so none is dropped) and the run
// ends when the bridge has had every one acknowledged by JetStream
// (kvbridge_batches_total).
//
// KVBRIDGE_BINS lists the binaries, "name=path,name=path" (e.g. an old and
// a new build side by side; each case runs them in turn); default: this
// tree's cmd/kvbridge, built into a temporary directory. NATS_SERVER_BIN is
// the server (default nats-server on PATH; `go build -o X
// github.com/nats-io/nats-server/v2` builds the version go.mod names).
func BenchmarkBridgeProcess(b *testing.B) {
	natsBin := os.Getenv("NATS_SERVER_BIN")
	if natsBin == "" {
		p, err := exec.LookPath("nats-server")
		if err != nil {
			b.Skip("no nats-server on PATH and NATS_SERVER_BIN unset")
		}
		natsBin = p
	}
	type bin struct{ name, path string }
	var bins []bin
	if s := os.Getenv("KVBRIDGE_BINS"); s != "" {
		for _, kv := range strings.Split(s, ",") {
			name, path, ok := strings.Cut(kv, "=")
			if !ok {
				b.Fatalf("KVBRIDGE_BINS: %q is not name=path", kv)
			}
			bins = append(bins, bin{name, path})
		}
	} else {
		path := filepath.Join(b.TempDir(), "kvbridge")
		if out, err := exec.Command("go", "build", "-o", path, "../cmd/kvbridge").CombinedOutput(); err != nil {
			b.Fatalf("go build: %v\n%s", err, out)
		}
		bins = append(bins, bin{"tree", path})
	}
	// Each set's payloads are made once, when a case of it first runs.
	sets := []struct {
		name string
		make func() [][]byte
		ps   [][]byte
	}{
		{name: "captured", make: func() [][]byte { return eventstest.CapturedPayloads(b, "array.jsonl") }},
		{name: "16blocks", make: func() [][]byte { return storedChains(b, 64, 16) }},
		// A table filling up: 61,440 batches of 16 new blocks (960 Ki
		// blocks, under kvbridge's default bound of 1 Mi), then the same
		// blocks stored again: the bridge with a table the size of an
		// engine's cache, which every garbage collection walks past.
		{name: "16blocks-fill", make: func() [][]byte { return storedChains(b, 61440, 16) }},
	}
	for i := range sets {
		set := &sets[i]
		for _, co := range []int{0, bridge.DefaultCoalesce} {
			for _, bn := range bins {
				b.Run(fmt.Sprintf("%s/coalesce%d/%s", set.name, co, bn.name), func(b *testing.B) {
					if set.ps == nil {
						set.ps = set.make()
					}
					runBridgeProcess(b, natsBin, bn.path, set.ps, co)
				})
			}
		}
	}
}

// storedChains makes n engine batches, each one BlockStored of a chain of
// fresh blocks continuing the previous batch's, with token ids drawn from
// a 150k vocabulary (their msgpack size is a real prompt's).
func storedChains(t testing.TB, n, blocks int) [][]byte {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, 2))
	out := make([][]byte, 0, n)
	next := uint64(1) << 40
	for i := 0; i < n; i++ {
		hs := make([]uint64, blocks)
		for j := range hs {
			hs[j] = next
			next++
		}
		toks := make([]uint32, 16*blocks)
		for j := range toks {
			toks[j] = rng.Uint32N(150000)
		}
		e := events.Event{Kind: events.BlockStored, BlockHashes: hs, TokenIDs: toks, BlockSize: 16, Medium: "GPU"}
		if i > 0 {
			e.ParentHash, e.HasParent = hs[0]-1, true
		}
		p, err := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{e}, HasDPRank: true}, events.EncodingArray)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// startProcess runs cmd until cleanup (then kills it); its output is kept
// and shown if the benchmark fails.
func startProcess(b *testing.B, cmd *exec.Cmd) *exec.Cmd {
	b.Helper()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if b.Failed() {
			b.Logf("%s:\n%s", filepath.Base(cmd.Path), out.String())
		}
	})
	return cmd
}

func runBridgeProcess(b *testing.B, natsBin, bridgeBin string, ps [][]byte, coalesce int) {
	blocks := eventstest.CountBlocks(b, ps)
	natsPort, listen := testenv.FreePort(b), fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(b))
	ns := startProcess(b, exec.Command(natsBin, "-a", "127.0.0.1", "-p", strconv.Itoa(natsPort), "-js", "-sd", b.TempDir()))
	const topic = "kv@127.0.0.1:8000@fake-model"
	pub := eventstest.NewStreamPUB(b, topic, ps)
	br := startProcess(b, exec.Command(bridgeBin,
		"--nats-url", fmt.Sprintf("nats://127.0.0.1:%d", natsPort), "--pool", "p", "--instance", "i0", "--model", "fake-model",
		"--engine-url", "http://127.0.0.1:8000", "--engine-probe-interval", "-1s",
		"--zmq-endpoint", pub.Endpoint(), "--replay-endpoint", "",
		"--buffer", strconv.Itoa(b.N+16), "--coalesce", strconv.Itoa(coalesce),
		"--snapshot-interval", "1h", "--listen", listen, "--log-level", "warn"))
	if err := pub.Accept(30 * time.Second); err != nil {
		b.Fatal(err)
	}
	testenv.WaitFor(b, 30*time.Second, "bridge ready", func() bool {
		r, err := http.Get("http://" + listen + "/readyz")
		if err != nil {
			return false
		}
		r.Body.Close()
		return r.StatusCode == http.StatusOK
	})
	// Scraped uncompressed: gzip made each scrape cost the bridge ms.
	scraper := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	metric := func(name string) float64 {
		r, err := scraper.Get("http://" + listen + "/metrics")
		if err != nil {
			b.Fatal(err)
		}
		defer r.Body.Close()
		sum := 0.0
		for s := bufio.NewScanner(r.Body); s.Scan(); {
			if rest, ok := strings.CutPrefix(s.Text(), name); ok && (rest[0] == '{' || rest[0] == ' ') {
				f, err := strconv.ParseFloat(rest[strings.LastIndexByte(rest, ' ')+1:], 64)
				if err != nil {
					b.Fatal(err)
				}
				sum += f
			}
		}
		return sum
	}
	brCPU0, nsCPU0, engCPU0 := cputime.OfProcess(br.Process.Pid), cputime.OfProcess(ns.Process.Pid), cputime.Process()
	// The counter holds the bridge's own messages too (the start-up
	// resync before it was ready): the engine's batches count from here.
	base := metric("kvbridge_batches_total")
	b.ResetTimer()
	start := time.Now()
	sent := make(chan error, 1)
	go func() { sent <- pub.Send(0, uint64(b.N)) }()
	deadline := start.Add(5 * time.Minute)
	for metric("kvbridge_batches_total")-base < float64(b.N) {
		if time.Now().After(deadline) {
			b.Fatalf("stuck: %v of %d batches published", metric("kvbridge_batches_total")-base, b.N)
		}
		time.Sleep(100 * time.Millisecond)
	}
	el := time.Since(start).Seconds()
	b.StopTimer()
	if err := <-sent; err != nil {
		b.Fatal(err)
	}
	brCPU := (cputime.OfProcess(br.Process.Pid) - brCPU0).Seconds()
	nsCPU := (cputime.OfProcess(ns.Process.Pid) - nsCPU0).Seconds()
	engCPU := (cputime.Process() - engCPU0).Seconds()
	if d, g := metric("kvbridge_drops_total"), metric("kvbridge_gaps_total"); d != 0 || g != 0 {
		b.Fatalf("bridge dropped %v messages, saw %v gaps", d, g)
	}
	n := float64(b.N)
	nblocks := n / float64(len(ps)) * float64(blocks)
	b.ReportMetric(n/el, "batches/s")
	b.ReportMetric(nblocks/el, "blocks/s")
	b.ReportMetric(brCPU*1e6/n, "bridge-cpu-µs/batch")
	b.ReportMetric(brCPU*1e9/nblocks, "bridge-cpu-ns/block")
	b.ReportMetric(nblocks/brCPU, "blocks/bridge-cpu-s")
	b.ReportMetric(nsCPU*1e6/n, "nats-cpu-µs/batch")
	b.ReportMetric(engCPU*1e6/n, "engine-cpu-µs/batch")
}
