package kvstream

import (
	"errors"
	"fmt"
	"strings"
)

// Subject roots of the NATS subjects kvrouter uses (docs/transport.md lists
// them). Every subject is <root>.<pool>.<instance>.
const (
	// SubjectEvents carries the engine's EventBatch payload, unchanged.
	SubjectEvents = "kv.events"
	// SubjectEvictions carries small JSON EvictionRecord documents.
	SubjectEvictions = "kv.evictions"
	// SubjectInstances carries bridge heartbeats (JSON Heartbeat).
	SubjectInstances = "kv.instances"
	// SubjectSnapshot is request-reply: the bridge answers with a Snapshot.
	SubjectSnapshot = "kv.snapshot"
)

// MaxTokenLen bounds a pool or instance name. Pod names are at most 63
// characters (DNS label); 128 leaves room for a rank suffix.
const MaxTokenLen = 128

// ErrBadToken is returned for a pool or instance name that cannot be a
// single NATS subject token and key-value key component.
var ErrBadToken = errors.New("kvstream: invalid subject token")

// ErrBadSubject is returned by ParseSubject for a subject that is not
// <root>.<pool>.<instance> with a known root.
var ErrBadSubject = errors.New("kvstream: invalid kv subject")

// ValidToken checks that s can be used as a pool or instance name: 1 to
// MaxTokenLen characters from [A-Za-z0-9_-]. The set is narrower than what
// NATS allows because the same names form JetStream key-value keys and
// Prometheus label values; dots would split a subject token, '*' and '>' are
// wildcards, and spaces or control bytes break the protocol line.
func ValidToken(what, s string) error {
	if s == "" {
		return fmt.Errorf("%w: %s is empty", ErrBadToken, what)
	}
	if len(s) > MaxTokenLen {
		return fmt.Errorf("%w: %s is %d bytes long (max %d)", ErrBadToken, what, len(s), MaxTokenLen)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
		default:
			return fmt.Errorf("%w: %s %q has %q at byte %d (allowed: letters, digits, '-', '_')", ErrBadToken, what, s, c, i)
		}
	}
	return nil
}

func subject(root, pool, instance string) (string, error) {
	if err := ValidToken("pool", pool); err != nil {
		return "", err
	}
	if err := ValidToken("instance", instance); err != nil {
		return "", err
	}
	return root + "." + pool + "." + instance, nil
}

// EventsSubject is kv.events.<pool>.<instance>.
func EventsSubject(pool, instance string) (string, error) {
	return subject(SubjectEvents, pool, instance)
}

// EvictionsSubject is kv.evictions.<pool>.<instance>.
func EvictionsSubject(pool, instance string) (string, error) {
	return subject(SubjectEvictions, pool, instance)
}

// InstancesSubject is kv.instances.<pool>.<instance>.
func InstancesSubject(pool, instance string) (string, error) {
	return subject(SubjectInstances, pool, instance)
}

// SnapshotSubject is kv.snapshot.<pool>.<instance>.
func SnapshotSubject(pool, instance string) (string, error) {
	return subject(SubjectSnapshot, pool, instance)
}

// PoolSubjects is the wildcard <root>.<pool>.> over every instance of a
// pool (root is one of the Subject* constants); pool "" means every pool
// (<root>.>).
func PoolSubjects(root, pool string) (string, error) {
	if pool == "" {
		return root + ".>", nil
	}
	if err := ValidToken("pool", pool); err != nil {
		return "", err
	}
	return root + "." + pool + ".>", nil
}

// ParseSubject splits a kv subject into its root (one of the Subject*
// constants), pool and instance, validating each.
func ParseSubject(s string) (root, pool, instance string, err error) {
	for _, r := range [...]string{SubjectEvents, SubjectEvictions, SubjectInstances, SubjectSnapshot} {
		if len(s) > len(r) && s[len(r)] == '.' && s[:len(r)] == r {
			rest := s[len(r)+1:]
			p, in, ok := strings.Cut(rest, ".")
			if !ok {
				return "", "", "", fmt.Errorf("%w: %q has no instance token", ErrBadSubject, s)
			}
			if err := ValidToken("pool", p); err != nil {
				return "", "", "", fmt.Errorf("%w: %q: %w", ErrBadSubject, s, err)
			}
			if err := ValidToken("instance", in); err != nil {
				return "", "", "", fmt.Errorf("%w: %q: %w", ErrBadSubject, s, err)
			}
			return r, p, in, nil
		}
	}
	return "", "", "", fmt.Errorf("%w: %q does not start with a kv subject root", ErrBadSubject, s)
}

// SnapshotKey is the key of an instance's latest snapshot in the snapshot
// key-value bucket: <pool>.<instance> (so a pool's keys list as <pool>.*).
func SnapshotKey(pool, instance string) (string, error) {
	if err := ValidToken("pool", pool); err != nil {
		return "", err
	}
	if err := ValidToken("instance", instance); err != nil {
		return "", err
	}
	return pool + "." + instance, nil
}
