package flowcontrol

import (
	"errors"
	"strconv"
	"strings"
	"time"
)

// ErrSyntax is wrapped by the parsers' errors.
var ErrSyntax = errors.New("flowcontrol: invalid value")

// MaxTTFTObjective bounds a TTFT objective given by a client: beyond an
// hour it is no objective, and a bound keeps the arithmetic far from
// overflow.
const MaxTTFTObjective = time.Hour

// ParsePriority parses a priority header: a base-10 integer in int64's
// range, optionally signed, surrounding spaces ignored.
func ParsePriority(s string) (int64, error) {
	s = strings.TrimSpace(s)
	p, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, errors.Join(ErrSyntax, errors.New("priority: want an integer"))
	}
	return p, nil
}

// PriorityJSON parses the raw JSON value of the OpenAI body's "priority"
// field as vLLM types it (an int64, default 0): an integer literal, or
// null (or no field at all) for the default. A number with a zero
// fraction or exponent ("2.0", "1e2") is accepted as that integer, as
// pydantic's lax integer mode does.
func PriorityJSON(raw []byte) (p int64, ok bool, err error) {
	s := strings.TrimSpace(string(raw))
	if s == "" || s == "null" {
		return 0, false, nil
	}
	if p, err := strconv.ParseInt(s, 10, 64); err == nil && s[0] != '+' {
		return p, true, nil
	}
	bad := errors.Join(ErrSyntax, errors.New("priority: want an integer"))
	if s[0] == '+' || s[0] == '"' || strings.ContainsAny(s, "xXpP_") {
		return 0, false, bad
	}
	f, ferr := strconv.ParseFloat(s, 64)
	// Within ±2^53 a float64 holds every integer exactly.
	if ferr != nil || f != float64(int64(f)) || f > 1<<53 || f < -(1<<53) || strings.HasPrefix(s, ".") || strings.HasSuffix(s, ".") {
		return 0, false, bad
	}
	return int64(f), true, nil
}

// ParseTTFTObjective parses a TTFT objective header in milliseconds: a
// positive integer up to MaxTTFTObjective.
func ParseTTFTObjective(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	ms, err := strconv.ParseInt(s, 10, 64)
	if err != nil || ms <= 0 || ms > MaxTTFTObjective.Milliseconds() || s[0] == '+' {
		return 0, errors.Join(ErrSyntax, errors.New("TTFT objective: want a positive integer of milliseconds up to 3600000"))
	}
	return time.Duration(ms) * time.Millisecond, nil
}
