package tokenizer

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"sync"
)

// UnmarshalExact decodes the JSON object b into the struct v points to as
// encoding/json does, except that a member's key must equal a field's JSON
// name exactly: a key equal to one only up to case (encoding/json's folding,
// Unicode's simple folding: "Messages", "MESSAGES", "meſſages") is ignored,
// as vLLM ignores it. vLLM reads a request with pydantic, whose field names
// are case-sensitive; OpenAIBaseModel (extra="allow") logs any other key as
// "present in the request but ignored" (vllm-project/vllm
// vllm/entrypoints/openai/protocol.py @ 0052bed), and a message is a
// TypedDict read by exact key (message["content"]). A body that is not an
// object decodes as encoding/json decodes it (the same errors).
func UnmarshalExact(b []byte, v any) error {
	t := reflect.TypeOf(v)
	if t == nil || t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return json.Unmarshal(b, v)
	}
	trimmed := bytes.TrimSpace(b)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return json.Unmarshal(b, v)
	}
	var members map[string]json.RawMessage
	if err := json.Unmarshal(trimmed, &members); err != nil {
		return json.Unmarshal(b, v)
	}
	names := jsonNames(t.Elem())
	dropped := false
	for k := range members {
		if names.exact[k] {
			continue
		}
		for _, n := range names.list {
			if strings.EqualFold(k, n) {
				delete(members, k)
				dropped = true
				break
			}
		}
	}
	if !dropped {
		return json.Unmarshal(b, v)
	}
	kept, err := json.Marshal(members)
	if err != nil {
		return err
	}
	return json.Unmarshal(kept, v)
}

// fieldNames are the JSON names encoding/json matches a struct's members
// against (embedded structs' included).
type fieldNames struct {
	exact map[string]bool
	list  []string
}

var fieldNameCache sync.Map // reflect.Type → *fieldNames

func jsonNames(t reflect.Type) *fieldNames {
	if n, ok := fieldNameCache.Load(t); ok {
		return n.(*fieldNames)
	}
	n := &fieldNames{exact: map[string]bool{}}
	var walk func(t reflect.Type, depth int)
	walk = func(t reflect.Type, depth int) {
		for i := range t.NumField() {
			f := t.Field(i)
			tag := f.Tag.Get("json")
			if tag == "-" {
				continue
			}
			name, _, _ := strings.Cut(tag, ",")
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if name == "" && f.Anonymous && ft.Kind() == reflect.Struct && depth < 8 {
				walk(ft, depth+1)
				continue
			}
			if !f.IsExported() {
				continue
			}
			if name == "" {
				name = f.Name
			}
			if !n.exact[name] {
				n.exact[name] = true
				n.list = append(n.list, name)
			}
		}
	}
	walk(t, 0)
	fieldNameCache.Store(t, n)
	return n
}
