package deploy

import (
	"encoding/json"
	"errors"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// vllmFlags are the `vllm serve` switches kvrouter relies on, beside
// --kv-events-config:
//   - --enable-prefix-caching: blocks are reused, and stored/removed events
//     exist at all (vLLM EngineArgs.enable_prefix_caching);
//   - --enable-prompt-tokens-details: responses carry
//     usage.prompt_tokens_details.cached_tokens, the engine-reported hits of
//     kvrouter_kv_engine_cached_tokens_total, shadow mode and `kvbench live`
//     (vLLM BaseFrontendArgs.enable_prompt_tokens_details, default False, in
//     vllm-project/vllm vllm/entrypoints/openai/cli_args.py; the flag name is
//     the field's with dashes; vllm-project/vllm#16162 discusses it).
var vllmFlags = []string{"--enable-prefix-caching", "--enable-prompt-tokens-details"}

// vllmEndpoints checks a `vllm serve` argument list (after the command
// words) for the flags kvrouter needs and returns where its KV events are
// published and replayed, as the sidecar on the pod's loopback reaches
// them, and their topic. The --kv-events-config JSON must be exactly
// vllmKVEventsConfig (field names of vLLM's KVEventsConfig,
// vllm/config/kv_events.py: enable_kv_cache_events, publisher, endpoint,
// replay_endpoint, topic).
func vllmEndpoints(t *testing.T, where string, args []string) (pub, replay, topic string) {
	t.Helper()
	for _, f := range vllmFlags {
		if !slices.Contains(args, f) {
			t.Errorf("%s: vllm serve without %s", where, f)
		}
	}
	i := slices.Index(args, "--kv-events-config")
	if i < 0 || i+1 >= len(args) {
		t.Fatalf("%s: no --kv-events-config", where)
	}
	var kv map[string]any
	if err := json.Unmarshal([]byte(args[i+1]), &kv); err != nil {
		t.Fatalf("%s: --kv-events-config: %v", where, err)
	}
	if !mapsEqual(kv, vllmKVEventsConfig) {
		t.Errorf("%s: --kv-events-config %v, want %v", where, kv, vllmKVEventsConfig)
	}
	// The engine binds every interface; the sidecar reaches it on loopback.
	pub = strings.Replace(kv["endpoint"].(string), "*", "127.0.0.1", 1)
	replay = strings.Replace(kv["replay_endpoint"].(string), "*", "127.0.0.1", 1)
	return pub, replay, kv["topic"].(string)
}

// checkBridgeEndpoints: the bridge reads what the engine publishes.
func checkBridgeEndpoints(t *testing.T, where string, bridgeArgs []string, pub, replay, topic string) {
	t.Helper()
	if v, _ := argValue(bridgeArgs, "zmq-endpoint"); v != pub {
		t.Errorf("%s: kvbridge --zmq-endpoint=%q, engine publishes on %q", where, v, pub)
	}
	if v, _ := argValue(bridgeArgs, "replay-endpoint"); v != replay {
		t.Errorf("%s: kvbridge --replay-endpoint=%q, engine replays on %q", where, v, replay)
	}
	if v, _ := argValue(bridgeArgs, "topic"); v != topic {
		t.Errorf("%s: kvbridge --topic=%q, engine topic %q", where, v, topic)
	}
}

// shellWords splits shell command lines the way sh does for the plain
// forms a README uses: backslash-newline continuations, single and double
// quotes, '#' comments at the start of a word; one command per line.
func shellWords(text string) ([][]string, error) {
	var cmds [][]string
	var words []string
	var cur strings.Builder
	inWord := false
	flushWord := func() {
		if inWord {
			words = append(words, cur.String())
			cur.Reset()
			inWord = false
		}
	}
	flushCmd := func() {
		flushWord()
		if len(words) > 0 {
			cmds = append(cmds, words)
			words = nil
		}
	}
	for i := 0; i < len(text); i++ {
		c := text[i]
		switch {
		case c == '\\' && i+1 < len(text) && text[i+1] == '\n':
			i++ // continuation
		case c == '\\' && i+1 < len(text):
			cur.WriteByte(text[i+1])
			inWord = true
			i++
		case c == '\'' || c == '"':
			j := strings.IndexByte(text[i+1:], c)
			if j < 0 {
				return nil, errors.New("unterminated quote")
			}
			cur.WriteString(text[i+1 : i+1+j])
			inWord = true
			i += j + 1
		case c == '#' && !inWord:
			for i < len(text) && text[i] != '\n' {
				i++
			}
			flushCmd()
		case c == '\n' || c == ';' || c == '&':
			flushCmd()
		case c == ' ' || c == '\t':
			flushWord()
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	flushCmd()
	return cmds, nil
}

func TestShellWords(t *testing.T) {
	got, err := shellWords("# comment\nvllm serve m \\\n  --x '{\"a\": \"*\"}' --y=\"b c\" # trailing\nkvbridge --p=1 &\n")
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{{"vllm", "serve", "m", "--x", `{"a": "*"}`, "--y=b c"}, {"kvbridge", "--p=1"}}
	if len(got) != len(want) {
		t.Fatalf("got %q, want %q", got, want)
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Errorf("command %d: got %q, want %q", i, got[i], want[i])
		}
	}
	if _, err := shellWords("echo 'open"); err == nil {
		t.Error("an unterminated quote was accepted")
	}
}

var codeBlock = regexp.MustCompile("(?ms)^```(?:sh|bash)?\n(.*?)^```")

// TestReadmeVLLMCommand: the README's one copy-pasteable `vllm serve`
// command carries every flag kvrouter needs, and the kvbridge command
// beside it passes only flags the binary has and reads what the engine
// publishes.
func TestReadmeVLLMCommand(t *testing.T) {
	var blocks []string
	for _, m := range codeBlock.FindAllStringSubmatch(readRepoFile(t, "README.md"), -1) {
		if strings.Contains(m[1], "vllm serve") {
			blocks = append(blocks, m[1])
		}
	}
	if len(blocks) != 1 {
		t.Fatalf("README: %d code blocks run `vllm serve`, want exactly one (the tested command)", len(blocks))
	}
	cmds, err := shellWords(blocks[0])
	if err != nil {
		t.Fatal(err)
	}
	var engine, bridge []string
	for _, c := range cmds {
		switch {
		case len(c) > 2 && c[0] == "vllm" && c[1] == "serve":
			engine = c[2:]
		case c[0] == "kvbridge" || strings.HasSuffix(c[0], "/kvbridge"):
			bridge = c[1:]
		}
	}
	if engine == nil || bridge == nil {
		t.Fatalf("README's vLLM block needs a `vllm serve` and a `kvbridge` command:\n%s", blocks[0])
	}
	pub, replay, topic := vllmEndpoints(t, "README vllm serve", engine)
	checkArgs(t, "README kvbridge", "kvbridge", bridge)
	checkBridgeEndpoints(t, "README", bridge, pub, replay, topic)
	if v, _ := argValue(bridge, "model"); v == "" || v != engine[0] {
		t.Errorf("README: kvbridge --model=%q, vllm serves %q", v, engine[0])
	}
	for _, f := range []string{"pool", "instance", "nats-url", "engine-url"} {
		if _, ok := argValue(bridge, f); !ok {
			t.Errorf("README kvbridge: --%s missing", f)
		}
	}
}
