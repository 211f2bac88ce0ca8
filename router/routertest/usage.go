package routertest

// Usage is the usage object of an OpenAI answer as vLLM writes it, for
// tests that decode one; Details.Cached is prompt_tokens_details'
// cached_tokens, the prompt tokens the engine's prefix cache served.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	Details          struct {
		Cached int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}
