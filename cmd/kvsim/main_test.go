package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/sim/simserver"
)

func TestFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		ok   bool
	}{
		{"defaults", nil, true},
		{"zero instances", []string{"--instances", "0"}, false},
		{"bad dp", []string{"--data-parallel-size", "0"}, false},
		{"ports overflow", []string{"--port", "65535", "--instances", "2"}, false},
		{"zmq overflow", []string{"--zmq-port", "65535", "--instances", "2"}, false},
		{"stray argument", []string{"extra"}, false},
		{"unknown flag", []string{"--nope"}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseFlags(tc.args, io.Discard)
			if (err == nil) != tc.ok {
				t.Fatalf("parseFlags(%q) = %v, want ok=%v", tc.args, err, tc.ok)
			}
		})
	}
	for _, bad := range [][]string{
		{"--event-encoding", "xml"}, {"--prefix-caching-hash-algo", "md5"}, {"--lora-modules", "noequals"}, {"--log-level", "loud"},
		{"--tokenizer-dir", "/nonexistent"}, {"--block-size", "-1", "--kv-events=false"},
	} {
		if err := run(context.Background(), append(bad, "--port", "0"), io.Discard, io.Discard, nil); err == nil {
			t.Errorf("run(%q) succeeded", bad)
		}
	}
}

// TestRunFleet starts two instances in-process, subscribes to their events
// with a plain SUB socket, and checks that a repeated prompt is served
// from cache and that events arrive from each instance.
func TestRunFleet(t *testing.T) {
	zmqBase := testenv.FreePorts(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan []*simserver.Instance, 1)
	done := make(chan error, 1)
	var out bytes.Buffer
	go func() {
		done <- run(ctx, []string{"--instances", "2", "--port", "0", "--zmq-port", fmt.Sprint(zmqBase),
			"--time-scale", "20", "--event-encoding", "map", "--lora-modules", "sql=/adapters/sql", "--gpu-blocks", "1000"},
			&out, io.Discard, func(f []*simserver.Instance) { ready <- f })
	}()
	var fleet []*simserver.Instance
	select {
	case fleet = <-ready:
	case err := <-done:
		t.Fatalf("run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("fleet did not start")
	}
	if len(fleet) != 2 || strings.Count(out.String(), "kvsim instance") != 2 {
		t.Fatalf("fleet %d, output %q", len(fleet), out.String())
	}
	for i, in := range fleet {
		sub := zmq4.NewSub(ctx)
		defer sub.Close()
		if err := sub.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", zmqBase+i)); err != nil {
			t.Fatal(err)
		}
		if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for !in.EventsSubscribed() {
			if time.Now().After(deadline) {
				t.Fatal("subscription never reached the publisher")
			}
			time.Sleep(5 * time.Millisecond)
		}
		prompt := strings.Repeat(fmt.Sprintf("instance %d shared context. ", i), 30)
		var cached []int
		for range 2 {
			resp := testenv.PostJSON(t, in.URL()+"/v1/completions", map[string]any{"model": "sql", "prompt": prompt, "max_tokens": 3})
			var u struct {
				Usage routertest.Usage `json:"usage"`
			}
			if err := json.Unmarshal(resp.Body, &u); err != nil || resp.Status != 200 {
				t.Fatalf("completion: %d %v", resp.Status, err)
			}
			cached = append(cached, u.Usage.Details.Cached)
			if u.Usage.PromptTokens < 32 {
				t.Fatalf("prompt tokens %d", u.Usage.PromptTokens)
			}
		}
		if cached[0] != 0 || cached[1] == 0 {
			t.Fatalf("instance %d cached_tokens %v, want [0, >0]", i, cached)
		}
		m := eventstest.Recv(t, sub)
		b, err := events.Decode(m.Payload)
		if err != nil || m.Seq != 1 || b.Encoding != events.EncodingMap || len(b.Events) == 0 ||
			b.Events[0].Kind != events.BlockStored || b.Events[0].LoraName != "sql" {
			t.Fatalf("instance %d first message seq %d batch %+v err %v", i, m.Seq, b, err)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run returned %v", err)
	}
}
