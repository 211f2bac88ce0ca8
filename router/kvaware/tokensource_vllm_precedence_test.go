package kvaware

import (
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// TestChatKwargsLoseToRequestFieldsAsVLLM: vLLM main gives the template the
// request's add_generation_prompt (true when absent) over one in
// chat_template_kwargs (ChatCompletionRequest.build_chat_params:
// merge_kwargs(chat_template_kwargs, {add_generation_prompt, ...}),
// vllm/entrypoints/openai/chat_completion/protocol.py @ 002032ee), so a
// chat sending {"chat_template_kwargs": {"add_generation_prompt": false}}
// is prefilled with Qwen3's assistant header: the router must key it so.
func TestChatKwargsLoseToRequestFieldsAsVLLM(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"Hi"}]`
	want := chatTokens(t, "qwen3", router.EndpointChatCompletions, `{"model":"m",`+msgs+`}`)
	for _, body := range []string{
		`{"model":"m","chat_template_kwargs":{"add_generation_prompt":false},` + msgs + `}`,
		`{"model":"m","add_generation_prompt":true,"chat_template_kwargs":{"add_generation_prompt":false},` + msgs + `}`,
	} {
		got := qwenDecode(t, chatTokens(t, "qwen3", router.EndpointChatCompletions, body))
		if w := qwenDecode(t, want); got != w {
			t.Errorf("%s:\nrendered %q\nwant     %q (the request's add_generation_prompt wins)", body, got, w)
		}
		if !strings.HasSuffix(got, "<|im_start|>assistant\n") {
			t.Errorf("%s: rendered %q without the generation prompt", body, got)
		}
	}
}
