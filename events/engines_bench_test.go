package events

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkEngineFormats reads one 8,192-token prompt (512 blocks of 16) as
// each source sends it, side by side in one run: vLLM's map form (one
// event), SGLang's (one event per page), TensorRT-LLM's JSON (decoded and
// converted to events, as kvbridge does before re-encoding). cpu-ns/op is
// the process's CPU time per op (wall time on a shared machine includes
// waiting for a core).
func BenchmarkEngineFormats(b *testing.B) {
	e := longPrompt()
	batch := Batch{TS: 1, Events: []Event{e}, HasDPRank: true}
	vllm, err := Encode(nil, batch, EncodingMap)
	if err != nil {
		b.Fatal(err)
	}
	sglang, err := EncodeSGLang(nil, batch, SGLangOptions{Medium: true})
	if err != nil {
		b.Fatal(err)
	}
	st := TRTLLMEvent{Type: "stored"}
	for j, h := range e.BlockHashes {
		st.Blocks = append(st.Blocks, TRTLLMBlock{Hash: h, Tokens: e.TokenIDs[16*j : 16*j+16], Priority: 35})
	}
	trt := AppendTRTLLMJSON(nil, []TRTLLMEvent{st})
	for _, c := range []struct {
		name string
		p    []byte
		run  func([]byte) error
	}{
		{"vllm-map", vllm, func(p []byte) error { _, err := Decode(p); return err }},
		{"sglang", sglang, func(p []byte) error { _, err := Decode(p); return err }},
		{"trtllm-json", trt, func(p []byte) error {
			evs, err := DecodeTRTLLM(p)
			if err == nil {
				var c TRTLLMConverter
				c.Convert(evs)
			}
			return err
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(c.p)))
			reportCPU := cputime.Report(b)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := c.run(c.p); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			reportCPU(b.N)
			b.ReportMetric(512*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
