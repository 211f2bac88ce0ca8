package openai

import "fmt"

// Limits bound what Parse builds from a body, so that the parsed form of a
// request stays within a fixed size whatever the body holds: a chat message
// is a ~170-byte struct, a prompt in a list a 16- or 24-byte slice header,
// and a body of "{}," messages or "[0]," prompts asks for one every three
// or four bytes. Each count is checked as the scan passes it, before the
// items beyond the limit are built. A zero field bounds nothing (the
// router passes its limits: section, config.LimitsConfig).
type Limits struct {
	// Messages bounds a chat request's messages.
	Messages int
	// ContentParts bounds the parts of array contents, all messages together.
	ContentParts int
	// Prompts bounds the prompts of a completions prompt given as a list
	// (of strings or of token-id lists).
	Prompts int
	// TokenIDs bounds a completions prompt's token ids, all prompts together.
	TokenIDs int
}

// LimitError is a body over one of Limits; its text is the client-facing
// message of a 400.
type LimitError struct {
	// Field is the request member ("messages", "prompt").
	Field string
	// What is the counted thing ("messages", "token ids", ...).
	What string
	// N is how many the body holds, Max the limit. AtLeast: the scan
	// stopped counting at N (content parts: the limit is over all
	// messages, and the later ones are not read).
	N, Max  int
	AtLeast bool
}

func (e *LimitError) Error() string {
	if e.AtLeast {
		return fmt.Sprintf("%s: %s exceed the limit of %d", e.Field, e.What, e.Max)
	}
	return fmt.Sprintf("%s: %d %s exceed the limit of %d", e.Field, e.N, e.What, e.Max)
}
