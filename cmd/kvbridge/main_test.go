package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestSources(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    []string // instance endpoint replay url, per rank
		wantErr string
	}{
		{"env identity", nil, map[string]string{"KVBRIDGE_POOL": "llama", "POD_NAME": "vllm-0", "POD_IP": "10.0.0.5"},
			[]string{"vllm-0 tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 http://10.0.0.5:8000"}, ""},
		{"dp ranks", []string{"--pool", "p", "--instance", "pod", "--dp-size", "2", "--zmq-endpoint", "tcp://e:6000", "--replay-endpoint", "", "--engine-url", "http://e:9000/v1"}, nil,
			[]string{"pod-dp0 tcp://e:6000  http://e:9000/v1", "pod-dp1 tcp://e:6001  http://e:9001/v1"}, ""},
		{"flag beats env", []string{"--pool", "a"}, map[string]string{"KVBRIDGE_POOL": "b", "POD_NAME": "x"},
			[]string{"x tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 http://127.0.0.1:8000"}, ""},
		{"no pool", nil, nil, nil, "--pool"},
		{"bad dp", []string{"--pool", "p", "--dp-size", "0"}, nil, nil, "dp-size"},
		// Refused by the flags, naming the flag, not by bridge.New's
		// "negative size or interval in config".
		{"negative buffer bytes", []string{"--pool", "p", "--buffer-bytes", "-1"}, nil, nil, "--buffer-bytes -1"},
		{"negative replay bytes", []string{"--pool", "p", "--replay-bytes", "-1"}, nil, nil, "--replay-bytes -1"},
		{"bad stream replicas", []string{"--pool", "p", "--stream-replicas", "6"}, nil, nil, "stream-replicas 6"},
		{"bad endpoint", []string{"--pool", "p", "--dp-size", "2", "--zmq-endpoint", "tcp://noport"}, nil, nil, "noport"},
		{"bad stream name", []string{"--pool", "p", "--stream", "EV/x"}, nil, nil, `--stream "EV/x": not a JetStream name`},
		{"bad bucket name", []string{"--pool", "p", "--bucket", "snap.x"}, nil, nil, `--bucket "snap.x": not a JetStream name`},
		{"custom stream and bucket", []string{"--pool", "p", "--stream", "EV_a-1", "--bucket", "SN_a-1"}, map[string]string{"POD_NAME": "s"},
			[]string{"s tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 http://127.0.0.1:8000"}, ""},
		{"sglang format", []string{"--pool", "p", "--format", "sglang"}, map[string]string{"POD_NAME": "sg"},
			[]string{"sg tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 http://127.0.0.1:8000"}, ""},
		{"format from env", []string{"--pool", "p"}, map[string]string{"POD_NAME": "t", "KVBRIDGE_FORMAT": "trtllm-json"},
			[]string{"t tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 http://127.0.0.1:8000"}, ""},
		{"bad format", []string{"--pool", "p", "--format", "tgi"}, nil, nil, "--format"},
		{"bad age-out", []string{"--pool", "p", "--age-out", "gpu=1m"}, nil, nil, "--age-out"},
		{"bad poll interval", []string{"--pool", "p", "--poll-interval", "0s"}, nil, nil, "--poll-interval"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseFlags(tc.args, env(tc.env), io.Discard)
			var got []string
			if err == nil {
				srcs, serr := o.sources()
				err = serr
				for _, s := range srcs {
					got = append(got, strings.Join([]string{s.Instance, s.Endpoint, s.ReplayEndpoint, s.URL}, " "))
				}
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want mention of %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if strings.Join(got, "|") != strings.Join(tc.want, "|") {
				t.Fatalf("got %q\nwant %q", got, tc.want)
			}
		})
	}
}

func TestRunServesMetricsAndReadiness(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, time.Minute))
	ns := testenv.StartNATS(t)
	pubEP := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	repEP := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	pub, err := enginezmq.NewPublisher(ctx, enginezmq.PublisherConfig{Endpoint: pubEP, ReplayEndpoint: repEP, Topic: "kv", FirstSeq: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	name := testenv.UniqueName(t)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--nats-url", ns.URL(), "--pool", "p_" + name, "--instance", "i0", "--zmq-endpoint", pubEP,
			"--replay-endpoint", repEP, "--first-seq", "1", "--listen", addr, "--stream", "S_" + name, "--bucket", "B_" + name, "--log-level", "warn"},
			env(nil), io.Discard)
	}()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if code, _ := get("/readyz"); code == http.StatusOK && pub.Subscribed() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("kvbridge never became ready")
		}
		time.Sleep(20 * time.Millisecond)
	}
	payload, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{{Kind: events.BlockStored,
		BlockHashes: []uint64{1, 2}, TokenIDs: make([]uint32, 32), BlockSize: 16, Medium: "GPU"}}}, events.EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pub.Publish(payload); err != nil {
		t.Fatal(err)
	}
	for {
		_, body := get("/metrics")
		if strings.Contains(body, `kvbridge_blocks_total{tier="gpu",type="BlockStored"} 2`) &&
			strings.Contains(body, `kvbridge_table_blocks{instance="i0"} 2`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics never showed the batch:\n%s", body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// /status is JSON: the bridge and each instance's counters.
	resp := testenv.Do(t, "GET", "http://"+addr+"/status", nil, nil)
	var st struct {
		Pool      string `json:"pool"`
		Ready     bool   `json:"ready"`
		Instances []struct {
			Instance  string `json:"instance"`
			Published uint64 `json:"published"`
			Blocks    int    `json:"blocks"`
			EngineSeq uint64 `json:"engine_seq"`
			// The engine counts from 1 (--first-seq 1): its first message
			// is its whole history, no replay failed for it.
			ReplayFailures uint64 `json:"replay_failures"`
		} `json:"instances"`
	}
	if derr := json.Unmarshal(resp.Body, &st); derr != nil || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("/status: %v, Content-Type %q", derr, resp.Header.Get("Content-Type"))
	}
	if st.Pool != "p_"+name || !st.Ready || len(st.Instances) != 1 || st.Instances[0].Instance != "i0" || st.Instances[0].Blocks != 2 || st.Instances[0].Published == 0 ||
		st.Instances[0].ReplayFailures != 0 {
		t.Errorf("/status %+v", st)
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("run: %v", err)
	}
}
