package routertest

import (
	"bytes"
	"encoding/json"
	"strings"
)

// ComparableWithStd reports whether body avoids the two places where the
// decoders differ on purpose: keys equal to a known field only up to case,
// and a known field repeated in one object.
func ComparableWithStd(body []byte) bool {
	known := []string{"model", "messages", "prompt", "stream", "prompt_cache_key", "role", "content", "text", "type",
		"cache_salt", "add_generation_prompt", "continue_final_message", "add_special_tokens", "tools", "chat_template_kwargs",
		"name", "tool_call_id", "reasoning_content", "tool_calls", "documents", "reasoning", "id", "function", "arguments", "inputs"}
	dec := json.NewDecoder(bytes.NewReader(body))
	type frame struct {
		obj  bool
		seen map[string]bool
		key  bool // next string token is a key
	}
	var st []*frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return true // the end, or invalid: both decoders must reject
		}
		var top *frame
		if len(st) > 0 {
			top = st[len(st)-1]
		}
		switch v := tok.(type) {
		case json.Delim:
			switch v {
			case '{':
				if top != nil && top.obj {
					top.key = true
				}
				st = append(st, &frame{obj: true, seen: map[string]bool{}, key: true})
				continue
			case '[':
				if top != nil && top.obj {
					top.key = true
				}
				st = append(st, &frame{})
				continue
			default:
				st = st[:len(st)-1]
				continue
			}
		case string:
			if top != nil && top.obj && top.key {
				for _, k := range known {
					if strings.EqualFold(v, k) || equalFoldJSON(v, k) {
						if v != k || top.seen[k] {
							return false
						}
						top.seen[k] = true
					}
				}
				top.key = false
				continue
			}
		}
		if top != nil && top.obj {
			top.key = true
		}
	}
}

// equalFoldJSON is encoding/json's looser folding (it also maps U+017F to
// 's' and U+212A to 'k').
func equalFoldJSON(a, b string) bool {
	r := strings.NewReplacer("\u017f", "s", "\u212a", "k")
	return strings.EqualFold(r.Replace(a), b)
}
