package httpapi

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

func TestParseModelList(t *testing.T) {
	doc := `{"object":"list","data":[{"id":"base","parent":null},{"id":"sql-lora","parent":"base","root":"/a"},{"id":""}]}`
	got, err := parseModelList(strings.NewReader(doc), "base")
	if err != nil || len(got) != 1 || got[0] != "sql-lora" {
		t.Fatalf("adapters %v %v", got, err)
	}
	if _, err := parseModelList(strings.NewReader("<html>"), "base"); err == nil {
		t.Fatal("HTML accepted as a model list")
	}
}

// FuzzParseModelList: never panics; adapters never include the base model.
func FuzzParseModelList(f *testing.F) {
	f.Add([]byte(`{"data":[{"id":"b"},{"id":"x","parent":"b"}]}`))
	f.Add([]byte(`{"data":null}`))
	f.Fuzz(func(t *testing.T, doc []byte) {
		names, err := parseModelList(bytes.NewReader(doc), "b")
		if err != nil {
			return
		}
		for _, n := range names {
			if n == "b" || n == "" {
				t.Fatalf("adapter %q", n)
			}
		}
	})
}

// FuzzParseConfig: any YAML either fails cleanly or validates without panic.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte("pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}]"))
	f.Add([]byte("listen: 1\npools: [{name: p, routing: {prefix_length: -1}}]"))
	f.Add([]byte("index: {backend: redis, redis: {ttl: 5x}}"))
	f.Fuzz(func(t *testing.T, doc []byte) {
		cfg, err := config.ParseConfig(bytes.NewReader(doc))
		if err != nil {
			return
		}
		if cfg.Validate() == nil {
			if _, err := NewServer(cfg, Options{}); err != nil {
				t.Fatalf("valid config but NewServer failed: %v", err)
			}
		}
	})
}
