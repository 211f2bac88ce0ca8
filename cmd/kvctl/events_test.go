package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/events/eventstest"
)

const captures = "../../events/testdata/captured/"

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var o, e bytes.Buffer
	code = run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}

func decodeLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var objs []map[string]any
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		d := json.NewDecoder(strings.NewReader(sc.Text()))
		d.UseNumber()
		var m map[string]any
		if err := d.Decode(&m); err != nil {
			t.Fatalf("output line %q: %v", sc.Text(), err)
		}
		objs = append(objs, m)
	}
	return objs
}

func TestHelpAndDispatch(t *testing.T) {
	tests := []struct {
		args     []string
		code     int
		stdout   string
		stderr   string
		notInOut string
	}{
		{[]string{"--help"}, 0, "events decode", "", ""},
		{[]string{"help"}, 0, "Commands:", "", ""},
		{nil, 2, "Usage: kvctl", "", ""},
		{[]string{"events"}, 2, "Usage: kvctl events <subcommand>", "", ""},
		{[]string{"events", "--help"}, 0, "events decode", "", ""},
		{[]string{"events", "decode", "--help"}, 0, "payload_b64", "", ""},
		{[]string{"events", "decode"}, 2, "Usage: kvctl events decode", "want exactly one FILE", ""},
		{[]string{"nope"}, 2, "", "unknown command", ""},
		{[]string{"--router", "http://127.0.0.1:1", "nope"}, 2, "", "unknown command", ""},
		// flags before the command go to it ("kvctl --router URL instances")
		{[]string{"--bogus", "events", "decode"}, 2, "Usage: kvctl events decode", "flag provided but not defined: -bogus", ""},
		{[]string{"--help", "events", "decode"}, 0, "Commands:", "", ""},
		{[]string{"events", "decode", "/does/not/exist"}, 1, "", "no such file", ""},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, out, errOut := runCLI(t, tc.args...)
			if code != tc.code {
				t.Errorf("exit %d, want %d (stderr %q)", code, tc.code, errOut)
			}
			if !strings.Contains(out, tc.stdout) {
				t.Errorf("stdout %q lacks %q", out, tc.stdout)
			}
			if !strings.Contains(errOut, tc.stderr) {
				t.Errorf("stderr %q lacks %q", errOut, tc.stderr)
			}
		})
	}
}

func TestEventsDecodeJSONL(t *testing.T) {
	tests := []struct {
		file   string
		events int // total events in the file (DATA.md)
	}{
		{"array.jsonl", -1}, {"map.jsonl", -1}, {"replay.array.jsonl", -1}, {"dp.array.jsonl", 3},
	}
	counts := map[string]int{}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			code, out, errOut := runCLI(t, "events", "decode", captures+tc.file)
			if code != 0 {
				t.Fatalf("exit %d: %s", code, errOut)
			}
			objs := decodeLines(t, out)
			counts[tc.file] = len(objs)
			if tc.events >= 0 && len(objs) != tc.events {
				t.Fatalf("%d events, want %d", len(objs), tc.events)
			}
			first := objs[0]
			if first["topic"] != "kv@127.0.0.1:18000@fake-model" || first["tier"] != "gpu" || first["full_attention"] != true {
				t.Fatalf("first event %v", first)
			}
			if tc.file == "replay.array.jsonl" && (first["seq"] != json.Number("3") || first["kind"] != "BlockRemoved") {
				t.Errorf("replay starts with %v", first)
			}
			if tc.file == "array.jsonl" {
				if first["kind"] != "BlockStored" || first["seq"] != json.Number("1") || first["rank"] != json.Number("0") || first["encoding"] != "array" ||
					len(first["hashes"].([]any)) != 12 || len(first["tokens"].([]any)) != 192 || first["parent"] != nil {
					t.Fatalf("first event %v", first)
				}
				// The LoRA store of seq 20.
				found := false
				for _, o := range objs {
					if o["lora"] == "lora-a" && o["lora_id"] == json.Number("1") && o["seq"] == json.Number("20") {
						found = true
					}
				}
				if !found {
					t.Error("LoRA event of seq 20 not printed")
				}
			}
			if tc.file == "dp.array.jsonl" && (objs[0]["rank"] != json.Number("0") || objs[2]["rank"] != json.Number("1")) {
				t.Errorf("ranks %v %v", objs[0]["rank"], objs[1]["rank"])
			}
		})
	}
	// The live stream and its replay from seq 3 hold the same batches.
	if counts["array.jsonl"] == 0 || counts["replay.array.jsonl"] >= counts["array.jsonl"] {
		t.Errorf("event counts %v", counts)
	}
}

func TestEventsDecodeRawAndStdin(t *testing.T) {
	payload := eventstest.CapturedPayloads(t, "array.jsonl")[0]
	raw := filepath.Join(t.TempDir(), "batch.msgpack")
	if err := os.WriteFile(raw, payload, 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "events", "decode", "-hex", "-no-tokens", raw)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	objs := decodeLines(t, out)
	if len(objs) != 4 {
		t.Fatalf("%d events, want 4", len(objs))
	}
	h := objs[0]["hashes"].([]any)[0].(string)
	if len(h) != 16 || objs[0]["tokens"] != nil || objs[0]["seq"] != nil {
		t.Errorf("hex/no-tokens output %v", objs[0])
	}
	if p := objs[1]["parent"]; p != objs[0]["hashes"].([]any)[11] {
		t.Errorf("parent %v is not the 12th hash of the first event", p)
	}

	// The same through stdin.
	r, w, _ := os.Pipe()
	old := os.Stdin
	os.Stdin = r
	defer func() { os.Stdin = old }()
	go func() { w.Write(payload); w.Close() }()
	code, out2, _ := runCLI(t, "events", "decode", "-hex", "-no-tokens", "-")
	if code != 0 || strings.ReplaceAll(out2, `"source":"-",`, "") != strings.ReplaceAll(out, `"source":"`+raw+`",`, "") {
		t.Errorf("stdin output differs:\n%s\n%s", out2, out)
	}
}

func TestEventsDecodeBadInput(t *testing.T) {
	dir := t.TempDir()
	good, _ := os.ReadFile(captures + "dp.array.jsonl")
	lines := strings.SplitN(string(good), "\n", 2)
	tests := []struct {
		name    string
		content string
		errors  int
		events  int
	}{
		{"truncated payload", `{"seq": 1, "payload_b64": "k8tB2sL6"}`, 1, 0},
		{"bad base64", `{"seq": 2, "payload_b64": "!!"}`, 1, 0},
		{"not json", "{nope\n" + lines[0], 1, 1},
		{"raw garbage", "\x93\x01", 1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_"))
			os.WriteFile(p, []byte(tc.content), 0o600)
			code, out, errOut := runCLI(t, "events", "decode", p)
			if code != 1 || errOut == "" {
				t.Fatalf("exit %d, stderr %q", code, errOut)
			}
			errs, evs := 0, 0
			for _, o := range decodeLines(t, out) {
				if o["error"] != nil {
					errs++
				} else {
					evs++
				}
			}
			if errs != tc.errors || evs != tc.events {
				t.Fatalf("%d errors, %d events; want %d, %d\n%s", errs, evs, tc.errors, tc.events, out)
			}
		})
	}
}
