package workload

import (
	"errors"
	"fmt"
	"sort"
	"time"
)

// ErrInvalid is wrapped by every configuration and trace validation error.
var ErrInvalid = errors.New("workload: invalid")

// Request is one inference request of a workload.
type Request struct {
	// ID numbers requests 0..n-1 in arrival order.
	ID int `json:"id"`
	// At is the arrival time, as an offset from the start of the run. Closed-loop
	// workloads ignore it.
	At time.Duration `json:"at"`
	// Session groups the turns of one conversation (or one user's requests);
	// Turn counts from 0 within it.
	Session string `json:"session,omitempty"`
	Turn    int    `json:"turn,omitempty"`
	// Tenant is the routing tenant key (X-Amzn-SageMaker-Prefix-Aware-Id or
	// prompt_cache_key); empty for none.
	Tenant string `json:"tenant,omitempty"`
	// Adapter names the LoRA adapter the request asks for; empty for the base model.
	Adapter string `json:"adapter,omitempty"`
	// Prompt is the prompt as a list of segments (see Segment).
	Prompt []Segment `json:"prompt"`
	// OutputTokens is the number of tokens the engine is asked to generate (max_tokens).
	OutputTokens int `json:"output_tokens"`
	// Priority is the request's priority for flow control (vLLM's
	// convention: lower is more urgent, 0 the default).
	Priority int64 `json:"priority,omitempty"`
	// TTFTObjective is the time to first token the request is meant to
	// meet (0 = none): flow control sheds what cannot meet it, and reports
	// count the requests that did.
	TTFTObjective time.Duration `json:"ttft_objective,omitempty"`
}

// InputTokens is the prompt length in tokens.
func (r *Request) InputTokens() int {
	n := 0
	for _, s := range r.Prompt {
		n += s.Len
	}
	return n
}

// AppendTokens appends the prompt's token ids to dst; the Simple tokenizer
// gives the same ids for Text().
func (r *Request) AppendTokens(dst []uint32) []uint32 {
	for _, s := range r.Prompt {
		dst = s.AppendTokens(dst)
	}
	return dst
}

// Tokens returns the prompt's token ids.
func (r *Request) Tokens() []uint32 { return r.AppendTokens(make([]uint32, 0, r.InputTokens())) }

// Text is the prompt's text form, to send as a completions prompt.
func (r *Request) Text() string { return segmentsText(r.Prompt) }

// Message is one chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Messages is the prompt as chat messages: consecutive segments with the
// same role (an empty role continues the previous one; the first defaults to
// "user") form one message. A chat template adds its own tokens around them,
// so the token ids of the rendered chat differ from Tokens(); equal message
// prefixes still render to equal token prefixes.
func (r *Request) Messages() []Message {
	var msgs []Message
	var buf []byte
	role := ""
	flush := func() {
		if role != "" {
			msgs = append(msgs, Message{Role: role, Content: string(buf)})
		}
		buf = buf[:0]
	}
	for _, s := range r.Prompt {
		sr := s.Role
		if sr == "" {
			sr = role
		}
		if sr == "" {
			sr = "user"
		}
		if sr != role {
			flush()
			role = sr
		}
		buf = s.AppendText(buf)
	}
	flush()
	return msgs
}

// FleetEventKind is a change to the fleet during a run.
type FleetEventKind uint8

const (
	// ScaleOut adds instances (empty caches).
	ScaleOut FleetEventKind = iota + 1
	// ScaleIn removes instances (the most recently added first); their
	// in-flight requests finish, they receive no new ones.
	ScaleIn
)

func (k FleetEventKind) String() string {
	switch k {
	case ScaleOut:
		return "scale-out"
	case ScaleIn:
		return "scale-in"
	}
	return "unknown"
}

// FleetEvent is a scale event at a point of the run.
type FleetEvent struct {
	At        time.Duration  `json:"at"`
	Kind      FleetEventKind `json:"kind"`
	Instances int            `json:"instances"`
}

// Workload is a generated or replayed request stream.
type Workload struct {
	Name     string       `json:"name"`
	Requests []Request    `json:"requests"`
	Fleet    []FleetEvent `json:"fleet,omitempty"`
	// ClosedLoop > 0 asks the driver to keep that many requests in flight,
	// issuing the next one (in ID order) when one completes, instead of
	// honouring At.
	ClosedLoop int `json:"closed_loop,omitempty"`
}

// Duration is the arrival time of the last request.
func (w *Workload) Duration() time.Duration {
	if len(w.Requests) == 0 {
		return 0
	}
	return w.Requests[len(w.Requests)-1].At
}

// InputTokens sums the prompt lengths.
func (w *Workload) InputTokens() int64 {
	var n int64
	for i := range w.Requests {
		n += int64(w.Requests[i].InputTokens())
	}
	return n
}

// finish sorts requests by arrival (stable, so equal times keep generation
// order), numbers them, and sorts fleet events.
func (w *Workload) finish() *Workload {
	sort.SliceStable(w.Requests, func(i, j int) bool { return w.Requests[i].At < w.Requests[j].At })
	for i := range w.Requests {
		w.Requests[i].ID = i
	}
	sort.SliceStable(w.Fleet, func(i, j int) bool { return w.Fleet[i].At < w.Fleet[j].At })
	return w
}

// Merge interleaves workloads by arrival time into one named workload.
// Sessions are prefixed with their workload's name so they stay distinct.
// Closed-loop workloads cannot be merged.
func Merge(name string, ws ...*Workload) (*Workload, error) {
	out := &Workload{Name: name}
	for _, w := range ws {
		if w.ClosedLoop > 0 {
			return nil, fmt.Errorf("%w: merge: workload %q is closed-loop", ErrInvalid, w.Name)
		}
		for _, r := range w.Requests {
			if r.Session != "" {
				r.Session = w.Name + "/" + r.Session
			}
			out.Requests = append(out.Requests, r)
		}
		out.Fleet = append(out.Fleet, w.Fleet...)
	}
	return out.finish(), nil
}

// TextPrefix is the first n bytes of Text() (the text is ASCII, so also
// its first n characters), built without materialising the rest: the
// routing text a prefix-hashing router reads.
func (r *Request) TextPrefix(n int) string {
	buf := make([]byte, 0, n+16)
	for _, s := range r.Prompt {
		for j := 0; j < s.Len && len(buf) < n; j++ {
			buf = appendWord(buf, WordIndex(s.Seed, j))
		}
		if len(buf) >= n {
			return string(buf[:n])
		}
	}
	return string(buf)
}
