package simserver

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// maxBody bounds request bodies (a 128k-token prompt is well under 4 MiB).
const maxBody = 16 << 20

var idSeq atomic.Uint64

// apiError writes vLLM's error shape: {"error": {message, type, param, code}}.
func apiError(w http.ResponseWriter, code int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"message": msg, "type": typ, "param": nil, "code": code,
	}})
}

func badRequest(w http.ResponseWriter, msg string) {
	apiError(w, http.StatusBadRequest, "BadRequestError", msg)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func readJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		badRequest(w, "cannot read body: "+err.Error())
		return false
	}
	if len(body) > maxBody {
		apiError(w, http.StatusRequestEntityTooLarge, "BadRequestError", "request body too large")
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		badRequest(w, "invalid JSON body: "+err.Error())
		return false
	}
	return true
}

// genParams are the fields both completion endpoints share.
type genParams struct {
	Model               string `json:"model"`
	MaxTokens           *int   `json:"max_tokens"`
	MaxCompletionTokens *int   `json:"max_completion_tokens"`
	Stream              bool   `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	CacheSalt *string `json:"cache_salt"`
	// KVTransferParams is vLLM's disaggregated-serving field (disagg.go).
	KVTransferParams *kvTransferParams `json:"kv_transfer_params"`
	// TruncatePromptTokens is vLLM's left truncation (keepLast).
	TruncatePromptTokens *int `json:"truncate_prompt_tokens"`
	// TruncationSide is vLLM main's side of it: "right" keeps the first
	// tokens, "left" (or absent) the last.
	TruncationSide *string `json:"truncation_side"`
}

// keepLast truncates each prompt to the last tokens the request's
// truncate_prompt_tokens k keeps, as vLLM's serving layer does
// (OpenAIServing._normalize_prompt_tokens_to_input: prompt_ids[-k:];
// text and chat prompts are tokenized with truncation on the left, which
// for a tokenizer adding no special tokens, as kvsim's simple one, is the
// same ids; -1 is max_model_len; vLLM v0.11). Other values are refused,
// as the router refuses to key them (router.PromptTruncation). On false
// the error answer has been written.
func (in *Instance) keepLast(w http.ResponseWriter, p *genParams, prompts [][]uint32) bool {
	if p.TruncatePromptTokens == nil {
		return true
	}
	k := *p.TruncatePromptTokens
	switch {
	case k == -1:
		k = in.cfg.Engine.MaxModelLenOrDefault()
	case k < 1:
		badRequest(w, fmt.Sprintf("truncate_prompt_tokens must be at least 1, or -1, got %d.", k))
		return false
	}
	right := false
	if side := p.TruncationSide; side != nil {
		// vLLM main: "right" keeps the first k (TokenizeParams._token_truncation,
		// vllm/renderers/params.py; the request's truncation_side).
		switch *side {
		case "left":
		case "right":
			right = true
		default:
			badRequest(w, fmt.Sprintf("truncation_side must be \"left\" or \"right\", got %q.", *side))
			return false
		}
	}
	for i, ids := range prompts {
		switch {
		case len(ids) <= k:
		case right:
			prompts[i] = ids[:k]
		default:
			prompts[i] = ids[len(ids)-k:]
		}
	}
	return true
}

// resolveModel maps the request's model to a LoRA name ("" = base model).
func (in *Instance) resolveModel(w http.ResponseWriter, model string) (lora string, ok bool) {
	switch {
	case model == "" || model == in.model:
		return "", true
	case in.hasLoRA(model):
		return model, true
	}
	apiError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", model))
	return "", false
}

// readGen reads a completion request's body into req, whose shared fields
// are p, and checks what both endpoints check first: the model (lora is
// the LoRA name, "" for the base model) and the token budget. On false
// the error answer has been written.
func (in *Instance) readGen(w http.ResponseWriter, r *http.Request, req any, p *genParams) (lora string, maxTok int, ok bool) {
	if !readJSON(w, r, req) {
		return "", 0, false
	}
	if lora, ok = in.resolveModel(w, p.Model); !ok {
		return "", 0, false
	}
	maxTok, ok = in.maxTokens(w, p)
	return lora, maxTok, ok
}

// salt is the request's cache_salt ("" when it has none).
func (p *genParams) salt() string {
	if p.CacheSalt == nil {
		return ""
	}
	return *p.CacheSalt
}

func (in *Instance) maxTokens(w http.ResponseWriter, p *genParams) (int, bool) {
	n := in.cfg.DefaultMaxTokens
	if p.MaxCompletionTokens != nil {
		n = *p.MaxCompletionTokens
	} else if p.MaxTokens != nil {
		n = *p.MaxTokens
	}
	if n < 1 {
		badRequest(w, fmt.Sprintf("max_tokens must be at least 1, got %d.", n))
		return 0, false
	}
	return n, true
}

// reply is a generated answer: n words of a fixed vocabulary chosen from
// the prompt, so a repeated prompt gets the same reply; each word (with its
// trailing space) is one token.
var vocab = strings.Fields(`the of and to in is that it for as with was on be by this are from
at or an have not which but all were can had one there their has been more also will other
its into only new some could time these two may first then do any like my now over such our
man me even most made after many before must through back years where much your way well`)

func reply(prompt []uint32, n int, tok tokenizer.Tokenizer) (pieces []string, ids []uint32) {
	var h uint64 = 1469598103934665603
	for _, t := range prompt {
		h = (h ^ uint64(t)) * 1099511628211
	}
	pieces = make([]string, n)
	ids = make([]uint32, n)
	for i := range n {
		h = h*6364136223846793005 + 1442695040888963407
		pieces[i] = vocab[(h>>33)%uint64(len(vocab))] + " "
		if t, err := tok.Encode(pieces[i]); err == nil && len(t) > 0 {
			ids[i] = t[0]
		}
	}
	return pieces, ids
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	TotalTokens         int `json:"total_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// job is one engine request behind an HTTP request.
type job struct {
	d      *driver
	id     uint64
	w      *waiter
	pieces []string
	prompt int
}

func (in *Instance) startJob(w http.ResponseWriter, prompt []uint32, maxTok int, lora, salt string, t transfer) (*job, bool) {
	if in.sleeping.Load() {
		apiError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "The engine is sleeping; POST /wake_up first.")
		return nil, false
	}
	if len(prompt) == 0 {
		badRequest(w, "The prompt is empty.")
		return nil, false
	}
	var err error
	if len(prompt)+maxTok > in.cfg.Engine.MaxModelLenOrDefault() {
		err = sim.ErrTooLong // before building a reply of maxTok words
	}
	var (
		d      *driver
		id     uint64
		wt     *waiter
		pieces []string
	)
	if err == nil {
		var ids []uint32
		pieces, ids = reply(prompt, maxTok, in.tok)
		d = in.pick()
		id, wt, err = d.submit(sim.Request{Prompt: prompt, MaxTokens: maxTok, Output: ids, LoRA: lora, CacheSalt: salt, RemotePrefill: t == transferDecode})
	}
	switch {
	case errors.Is(err, sim.ErrTooLong):
		badRequest(w, fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			in.cfg.Engine.MaxModelLenOrDefault(), len(prompt)+maxTok, len(prompt), maxTok))
		return nil, false
	case errors.Is(err, sim.ErrUnknownAdapter):
		apiError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", lora))
		return nil, false
	case err != nil:
		badRequest(w, err.Error())
		return nil, false
	}
	return &job{d: d, id: id, w: wt, pieces: pieces, prompt: len(prompt)}, true
}

// maxTokens is the number of tokens the job generates.
func (j *job) maxTokens() int { return len(j.pieces) }

// next blocks for the job's next updates; nil when the client went away.
func (j *job) next(r *http.Request) []sim.Update {
	for {
		if u := j.w.take(); len(u) > 0 {
			return u
		}
		select {
		case <-r.Context().Done():
			j.d.abort(j.id)
			return nil
		case <-j.w.notify:
		}
	}
}

// wait blocks until the job ends and returns its last update.
func (j *job) wait(r *http.Request) (sim.Update, bool) {
	for {
		ups := j.next(r)
		if ups == nil {
			return sim.Update{}, false
		}
		last := ups[len(ups)-1]
		if last.Kind == sim.Finished || last.Kind == sim.Aborted {
			return last, last.Kind == sim.Finished
		}
	}
}

func makeUsage(prompt, completion, cached int) usage {
	u := usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion}
	u.PromptTokensDetails.CachedTokens = cached
	return u
}

// completionPrompts accepts vLLM's prompt forms: a string, a list of
// strings, a list of token ids, or a list of lists of token ids.
func (in *Instance) completionPrompts(raw json.RawMessage) ([][]uint32, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, errors.New("prompt is required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		ids, err := in.tok.Encode(s)
		return [][]uint32{ids}, err
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil && len(ss) > 0 {
		out := make([][]uint32, len(ss))
		for i, s := range ss {
			ids, err := in.tok.Encode(s)
			if err != nil {
				return nil, err
			}
			out[i] = ids
		}
		return out, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil && len(ids) > 0 {
		return [][]uint32{ids}, nil
	}
	var idss [][]uint32
	if json.Unmarshal(raw, &idss) == nil && len(idss) > 0 {
		return idss, nil
	}
	return nil, errors.New("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids")
}

type completionRequest struct {
	genParams
	Prompt json.RawMessage `json:"prompt"`
}

func (in *Instance) handleCompletions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	lora, maxTok, ok := in.readGen(w, r, &req, &req.genParams)
	if !ok {
		return
	}
	prompts, err := in.completionPrompts(req.Prompt)
	if err != nil {
		badRequest(w, err.Error())
		return
	}
	if !in.keepLast(w, &req.genParams, prompts) {
		return
	}
	tr, ok := in.checkTransfer(w, &req.genParams)
	if !ok {
		return
	}
	if tr != transferNone && len(prompts) != 1 {
		badRequest(w, "kv_transfer_params takes one prompt per request")
		return
	}
	if len(prompts) > 1024 {
		badRequest(w, "too many prompts in one request (max 1024)")
		return
	}
	salt := req.salt()
	jobs := make([]*job, 0, len(prompts))
	for _, p := range prompts {
		j, ok := in.startJob(w, p, maxTok, lora, salt, tr)
		if !ok {
			for _, j := range jobs {
				j.d.abort(j.id)
			}
			return
		}
		jobs = append(jobs, j)
	}
	id := fmt.Sprintf("cmpl-%016x", idSeq.Add(1))
	model := req.Model
	if model == "" {
		model = in.model
	}
	created := time.Now().Unix()
	if req.Stream {
		in.streamCompletions(w, r, jobs, id, model, created, req.StreamOptions != nil && req.StreamOptions.IncludeUsage)
		return
	}
	choices := make([]map[string]any, len(jobs))
	var total usage
	for i, j := range jobs {
		last, ok := j.wait(r)
		if !ok {
			return
		}
		choices[i] = map[string]any{
			"index": i, "text": strings.Join(j.pieces, ""), "logprobs": nil,
			"finish_reason": "length", "stop_reason": nil, "prompt_logprobs": nil,
		}
		u := makeUsage(j.prompt, last.OutputTokens, last.CachedTokens)
		total.PromptTokens += u.PromptTokens
		total.CompletionTokens += u.CompletionTokens
		total.TotalTokens += u.TotalTokens
		total.PromptTokensDetails.CachedTokens += u.PromptTokensDetails.CachedTokens
	}
	writeJSON(w, map[string]any{
		"id": id, "object": "text_completion", "created": created, "model": model,
		"choices": choices, "usage": total, "service_tier": nil, "system_fingerprint": nil, "kv_transfer_params": in.transferAnswer(tr, total.PromptTokens),
	})
}

// sse writes one server-sent event and flushes it.
func sse(w http.ResponseWriter, v any) {
	b, _ := json.Marshal(v)
	fmt.Fprintf(w, "data: %s\n\n", b)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

func startSSE(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

func endSSE(w http.ResponseWriter) {
	fmt.Fprint(w, "data: [DONE]\n\n")
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

// streamJobs multiplexes the jobs' token updates in arrival order; emit
// is called once per token with the choice index (the last one with
// u.Kind == sim.Finished), and done once per job. When the engine reports
// the last token both as first and as finished (max_tokens 1), emit sees it
// once; a Finished update with no new token gets emit(i, u, false): a
// closing chunk without text.
func streamJobs(r *http.Request, jobs []*job, emit func(i int, u sim.Update, text bool), done func(i int, u sim.Update)) bool {
	// One goroutine per extra job would be simpler but costs more than a
	// poll over the jobs' notify channels for the common single-prompt case.
	live := len(jobs)
	finished := make([]bool, len(jobs))
	sent := make([]int, len(jobs)) // tokens emitted per job
	for live > 0 {
		progressed := false
		for i, j := range jobs {
			if finished[i] {
				continue
			}
			for _, u := range j.w.take() {
				progressed = true
				switch u.Kind {
				case sim.FirstToken, sim.Token:
					if u.OutputTokens > sent[i] && u.OutputTokens < jobs[i].maxTokens() {
						sent[i] = u.OutputTokens
						emit(i, u, true)
					}
				case sim.Finished:
					emit(i, u, u.OutputTokens > sent[i])
					sent[i] = u.OutputTokens
					done(i, u)
					finished[i] = true
					live--
				case sim.Aborted:
					finished[i] = true
					live--
				}
			}
		}
		if progressed || live == 0 {
			continue
		}
		if len(jobs) == 1 {
			select {
			case <-r.Context().Done():
				jobs[0].d.abort(jobs[0].id)
				return false
			case <-jobs[0].w.notify:
			}
			continue
		}
		select {
		case <-r.Context().Done():
			for _, j := range jobs {
				j.d.abort(j.id)
			}
			return false
		case <-time.After(time.Millisecond):
		}
	}
	return true
}

func (in *Instance) streamCompletions(w http.ResponseWriter, r *http.Request, jobs []*job, id, model string, created int64, includeUsage bool) {
	startSSE(w)
	var total usage
	ok := streamJobs(r, jobs, func(i int, u sim.Update, withText bool) {
		text := ""
		if withText {
			text = jobs[i].pieces[u.OutputTokens-1]
		}
		choice := map[string]any{"index": i, "text": text, "logprobs": nil, "finish_reason": nil, "stop_reason": nil}
		if u.Kind == sim.Finished {
			choice["finish_reason"] = "length"
		}
		sse(w, map[string]any{"id": id, "object": "text_completion", "created": created, "model": model, "choices": []any{choice}})
	}, func(i int, u sim.Update) {
		total.PromptTokens += jobs[i].prompt
		total.CompletionTokens += u.OutputTokens
		total.TotalTokens += jobs[i].prompt + u.OutputTokens
		total.PromptTokensDetails.CachedTokens += u.CachedTokens
	})
	if !ok {
		return
	}
	if includeUsage {
		sse(w, map[string]any{"id": id, "object": "text_completion", "created": created, "model": model, "choices": []any{}, "usage": total})
	}
	endSSE(w)
}

type chatRequest struct {
	genParams
	Messages            []tokenizer.Message `json:"messages"`
	AddGenerationPrompt *bool               `json:"add_generation_prompt"`
	Tools               json.RawMessage     `json:"tools"`
	ChatTemplateKwargs  map[string]any      `json:"chat_template_kwargs"`
}

func (in *Instance) chatTokens(req *chatRequest) ([]uint32, error) {
	if len(req.Messages) == 0 {
		return nil, errors.New("messages must not be empty")
	}
	agp := true // vLLM's default for chat requests
	if req.AddGenerationPrompt != nil {
		agp = *req.AddGenerationPrompt
	}
	ids, _, err := tokenizer.EncodeChat(in.tok, req.Messages, tokenizer.RenderOptions{
		AddGenerationPrompt: agp, Tools: req.Tools, Vars: req.ChatTemplateKwargs,
	})
	return ids, err
}

func (in *Instance) handleChat(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	lora, maxTok, ok := in.readGen(w, r, &req, &req.genParams)
	if !ok {
		return
	}
	prompt, err := in.chatTokens(&req)
	if err != nil {
		badRequest(w, err.Error())
		return
	}
	kept := [][]uint32{prompt}
	if !in.keepLast(w, &req.genParams, kept) {
		return
	}
	prompt = kept[0]
	tr, ok := in.checkTransfer(w, &req.genParams)
	if !ok {
		return
	}
	salt := req.salt()
	j, ok := in.startJob(w, prompt, maxTok, lora, salt, tr)
	if !ok {
		return
	}
	id := fmt.Sprintf("chatcmpl-%016x", idSeq.Add(1))
	model := req.Model
	if model == "" {
		model = in.model
	}
	created := time.Now().Unix()
	if !req.Stream {
		last, ok := j.wait(r)
		if !ok {
			return
		}
		writeJSON(w, map[string]any{
			"id": id, "object": "chat.completion", "created": created, "model": model,
			"choices": []any{map[string]any{
				"index":    0,
				"message":  map[string]any{"role": "assistant", "content": strings.Join(j.pieces, ""), "reasoning_content": nil, "tool_calls": []any{}},
				"logprobs": nil, "finish_reason": "length", "stop_reason": nil,
			}},
			"usage": makeUsage(j.prompt, last.OutputTokens, last.CachedTokens), "prompt_logprobs": nil, "kv_transfer_params": in.transferAnswer(tr, j.prompt),
		})
		return
	}
	includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	startSSE(w)
	chunk := func(delta map[string]any, finish any) map[string]any {
		return map[string]any{"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
			"choices": []any{map[string]any{"index": 0, "delta": delta, "logprobs": nil, "finish_reason": finish}}}
	}
	var final sim.Update
	opened := false
	ok = streamJobs(r, []*job{j}, func(_ int, u sim.Update, withText bool) {
		if !opened {
			// vLLM opens the stream with the role and empty content.
			opened = true
			sse(w, chunk(map[string]any{"role": "assistant", "content": ""}, nil))
		}
		var finish any
		if u.Kind == sim.Finished {
			finish = "length"
		}
		delta := map[string]any{}
		if withText {
			delta["content"] = j.pieces[u.OutputTokens-1]
		}
		sse(w, chunk(delta, finish))
	}, func(_ int, u sim.Update) { final = u })
	if !ok {
		return
	}
	if includeUsage {
		sse(w, map[string]any{"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
			"choices": []any{}, "usage": makeUsage(j.prompt, final.OutputTokens, final.CachedTokens)})
	}
	endSSE(w)
}

func (in *Instance) handleModels(w http.ResponseWriter, _ *http.Request) {
	perm := func(root string) []any {
		return []any{map[string]any{
			"id": fmt.Sprintf("modelperm-%x", len(root)), "object": "model_permission", "created": in.created,
			"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true, "allow_search_indices": false,
			"allow_view": true, "allow_fine_tuning": false, "organization": "*", "group": nil, "is_blocking": false,
		}}
	}
	data := []any{map[string]any{
		"id": in.model, "object": "model", "created": in.created, "owned_by": "vllm",
		"root": in.model, "parent": nil, "max_model_len": in.cfg.Engine.MaxModelLenOrDefault(), "permission": perm(in.model),
	}}
	for _, l := range in.LoRAs() {
		data = append(data, map[string]any{
			"id": l[0], "object": "model", "created": in.created, "owned_by": "vllm",
			"root": l[1], "parent": in.model, "max_model_len": nil, "permission": perm(l[0]),
		})
	}
	writeJSON(w, map[string]any{"object": "list", "data": data})
}

func (in *Instance) handleLoadLoRA(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"lora_name"`
		Path string `json:"lora_path"`
	}
	if !readJSON(w, r, &req) {
		return
	}
	if req.Name == "" || req.Path == "" {
		apiError(w, http.StatusBadRequest, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
		return
	}
	if err := in.LoadLoRA(req.Name, req.Path); err != nil {
		apiError(w, http.StatusBadRequest, "InvalidUserInput", fmt.Sprintf("The lora adapter '%s' has already been loaded.", req.Name))
		return
	}
	loraDone(w, req.Name, "added")
}

// loraDone answers a LoRA load or unload as vLLM does: plain text.
func loraDone(w http.ResponseWriter, name, done string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' %s successfully.", name, done)
}

func (in *Instance) handleUnloadLoRA(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"lora_name"`
	}
	if !readJSON(w, r, &req) {
		return
	}
	if err := in.UnloadLoRA(req.Name); err != nil {
		apiError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The lora adapter '%s' cannot be found.", req.Name))
		return
	}
	loraDone(w, req.Name, "removed")
}

// handleTokenize serves vLLM's /tokenize: {prompt} or {messages}, answering
// {count, max_model_len, tokens, token_strs}.
func (in *Instance) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req struct {
		chatRequest
		Prompt *string `json:"prompt"`
	}
	if !readJSON(w, r, &req) {
		return
	}
	if _, ok := in.resolveModel(w, req.Model); !ok {
		return
	}
	var ids []uint32
	var err error
	switch {
	case req.Prompt != nil:
		ids, err = in.tok.Encode(*req.Prompt)
	case req.Messages != nil:
		ids, err = in.chatTokens(&req.chatRequest)
	default:
		err = errors.New("either prompt or messages is required")
	}
	if err != nil {
		badRequest(w, err.Error())
		return
	}
	if ids == nil {
		ids = []uint32{}
	}
	writeJSON(w, map[string]any{"count": len(ids), "max_model_len": in.cfg.Engine.MaxModelLenOrDefault(), "tokens": ids, "token_strs": nil})
}

func (in *Instance) handleReset(w http.ResponseWriter, _ *http.Request) {
	if err := in.ResetPrefixCache(); err != nil {
		// vLLM only logs a refused reset; answering 409 lets tests and
		// operators see it.
		apiError(w, http.StatusConflict, "ConflictError", "prefix cache not reset: "+err.Error())
		return
	}
	w.WriteHeader(http.StatusOK)
}

// handleSleep is vLLM's dev-mode /sleep: the engine drops its KV cache
// (AllBlocksCleared goes out) and serves nothing until /wake_up. Like
// reset, it needs the engine idle.
func (in *Instance) handleSleep(w http.ResponseWriter, _ *http.Request) {
	if err := in.ResetPrefixCache(); err != nil {
		apiError(w, http.StatusConflict, "ConflictError", "cannot sleep: "+err.Error())
		return
	}
	in.sleeping.Store(true)
	w.WriteHeader(http.StatusOK)
}

func (in *Instance) handleWake(w http.ResponseWriter, _ *http.Request) {
	in.sleeping.Store(false)
	w.WriteHeader(http.StatusOK)
}

func (in *Instance) handleIsSleeping(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, map[string]bool{"is_sleeping": in.sleeping.Load()})
}
