package kvstream

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
)

// Heartbeats announce where an instance serves (Heartbeat.URL), and the
// router adds announced instances to its pools. Where NATS itself does not
// authenticate publishers, a shared key authenticates heartbeats instead:
// the bridge puts HMAC-SHA256(key, domain || subject || 0 || payload) in
// the Kv-Signature header, and a router holding the key refuses heartbeats
// without a valid one. The subject is covered so that a heartbeat signed
// for one pool or instance cannot be replayed under another; the payload
// carries the time, which the router checks for freshness.

// HeaderSignature carries a heartbeat's signature: "v1=" and 64 hex digits.
const HeaderSignature = "Kv-Signature"

// MinHeartbeatKeyBytes is the shortest heartbeat key accepted (128 bits).
const MinHeartbeatKeyBytes = 16

// heartbeatSigDomain separates these HMACs from other uses of the key.
const heartbeatSigDomain = "kvrouter heartbeat v1\x00"

// Heartbeat signature errors.
var (
	ErrUnsigned     = errors.New("kvstream: heartbeat not signed")
	ErrBadSignature = errors.New("kvstream: heartbeat signature does not verify")
)

// DecodeHeartbeatKey decodes a hex heartbeat key ("" = none).
func DecodeHeartbeatKey(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	b, err := hex.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("kvstream: heartbeat key: want hex: %w", err)
	}
	if len(b) < MinHeartbeatKeyBytes {
		return nil, fmt.Errorf("kvstream: heartbeat key: %d bytes, want at least %d (e.g. openssl rand -hex 32)", len(b), MinHeartbeatKeyBytes)
	}
	return b, nil
}

func heartbeatMAC(key []byte, subject string, data []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(heartbeatSigDomain))
	m.Write([]byte(subject))
	m.Write([]byte{0})
	m.Write(data)
	return m.Sum(nil)
}

// SignHeartbeat returns the Kv-Signature value of a heartbeat payload
// published on subject.
func SignHeartbeat(key []byte, subject string, data []byte) string {
	return "v1=" + hex.EncodeToString(heartbeatMAC(key, subject, data))
}

// VerifyHeartbeat checks the Kv-Signature header of a heartbeat received
// on subject: ErrUnsigned without one, ErrBadSignature when it is
// malformed or does not match (compared in constant time).
func VerifyHeartbeat(key []byte, subject string, data []byte, h nats.Header) error {
	vals := h.Values(HeaderSignature)
	if len(vals) == 0 {
		return ErrUnsigned
	}
	if len(vals) > 1 {
		return fmt.Errorf("%w: %d signature headers", ErrBadSignature, len(vals))
	}
	hexSig, ok := strings.CutPrefix(vals[0], "v1=")
	if !ok || len(hexSig) != 2*sha256.Size {
		return fmt.Errorf("%w: want v1= and %d hex digits", ErrBadSignature, 2*sha256.Size)
	}
	got, err := hex.DecodeString(hexSig)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrBadSignature, err)
	}
	if !hmac.Equal(got, heartbeatMAC(key, subject, data)) {
		return ErrBadSignature
	}
	return nil
}
