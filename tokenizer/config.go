package tokenizer

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// Config selects and configures one pool's token source, for binaries that build it from
// a config file. The zero value means no tokenizer (heuristic routing only).
type Config struct {
	// Source is "" or "none" (no tokenizer), "simple" (the llm-d-inference-sim dummy
	// tokenizer, for kvsim fleets), "hf" (the model's files in ModelDir) or "remote" (the
	// engine's /tokenize at URL).
	Source string `yaml:"source" json:"source"`
	// ModelDir holds tokenizer.json (or .gz), tokenizer_config.json and optionally
	// chat_template.jinja (Source "hf").
	ModelDir string `yaml:"model_dir" json:"model_dir"`
	// ChatTemplateFile overrides the model's chat template, like vLLM's --chat-template
	// (Source "hf"); give the router the same file as the engine.
	ChatTemplateFile string `yaml:"chat_template_file" json:"chat_template_file"`
	// URL is the engine's base URL (Source "remote").
	URL string `yaml:"url" json:"url"`
	// Model is sent as "model" to /tokenize (Source "remote"); empty omits it.
	Model string `yaml:"model" json:"model"`
	// Timeout bounds one /tokenize call (Source "remote"); 0 means 2 s.
	Timeout time.Duration `yaml:"timeout" json:"timeout"`
	// CacheEntries bounds the piece cache (hf: 0 = 65,536 pieces) or the prompt LRU
	// (remote: 0 = 4,096 prompts); negative disables it.
	CacheEntries int `yaml:"cache_entries" json:"cache_entries"`
	// SegmentCacheBytes bounds the hf segment cache; 0 = 64 MB, negative disables it.
	SegmentCacheBytes int `yaml:"segment_cache_bytes" json:"segment_cache_bytes"`
}

// ErrConfig reports an invalid Config.
var ErrConfig = errors.New("tokenizer: invalid config")

// Open builds the token source cfg describes. It returns (nil, nil) for Source "" or
// "none": the caller routes heuristically. Loading model files takes about a second.
func Open(cfg Config) (PromptTokenizer, error) {
	switch strings.ToLower(cfg.Source) {
	case "", "none":
		return nil, nil
	case "simple":
		return Local(Simple{}), nil
	case "hf":
		if cfg.ModelDir == "" {
			return nil, fmt.Errorf("%w: source hf needs model_dir", ErrConfig)
		}
		hc := HFConfig{CacheEntries: cfg.CacheEntries, SegmentCacheBytes: cfg.SegmentCacheBytes}
		if cfg.ChatTemplateFile != "" {
			b, err := os.ReadFile(cfg.ChatTemplateFile)
			if err != nil {
				return nil, fmt.Errorf("%w: chat_template_file: %w", ErrConfig, err)
			}
			hc.ChatTemplate = string(b)
		}
		t, err := LoadHF(cfg.ModelDir, hc)
		if err != nil {
			return nil, err
		}
		return Local(t), nil
	case "remote":
		r, err := NewRemote(RemoteConfig{URL: cfg.URL, Model: cfg.Model, Timeout: cfg.Timeout, CacheEntries: cfg.CacheEntries})
		if err != nil {
			return nil, err
		}
		return r, nil
	}
	return nil, fmt.Errorf("%w: source %q (want none, simple, hf or remote)", ErrConfig, cfg.Source)
}
