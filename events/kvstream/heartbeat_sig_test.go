package kvstream

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

func TestHeartbeatSignature(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	subj, data := "kv.instances.p.vllm-0", []byte(`{"url":"http://10.0.0.1:8000"}`)
	sig := SignHeartbeat(key, subj, data)
	h := nats.Header{}
	h.Set(HeaderSignature, sig)
	if err := VerifyHeartbeat(key, subj, data, h); err != nil {
		t.Fatalf("valid signature refused: %v", err)
	}
	flip := func(s string) string {
		b := []byte(s)
		b[len(b)-1] ^= 1
		return string(b)
	}
	tests := []struct {
		name    string
		key     []byte
		subject string
		data    []byte
		header  []string
		want    error
	}{
		{"unsigned", key, subj, data, nil, ErrUnsigned},
		{"other key", []byte("fedcba9876543210fedcba9876543210"), subj, data, []string{sig}, ErrBadSignature},
		{"other instance", key, "kv.instances.p.vllm-1", data, []string{sig}, ErrBadSignature},
		{"other payload", key, subj, []byte(`{"url":"http://10.0.0.2:8000"}`), []string{sig}, ErrBadSignature},
		{"flipped digit", key, subj, data, []string{flip(sig)}, ErrBadSignature},
		{"no version", key, subj, data, []string{strings.TrimPrefix(sig, "v1=")}, ErrBadSignature},
		{"not hex", key, subj, data, []string{"v1=" + strings.Repeat("z", 64)}, ErrBadSignature},
		{"two signatures", key, subj, data, []string{sig, sig}, ErrBadSignature},
	}
	for _, tc := range tests {
		h := nats.Header{}
		for _, v := range tc.header {
			h.Add(HeaderSignature, v)
		}
		if err := VerifyHeartbeat(tc.key, tc.subject, tc.data, h); !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
	}
}

func TestDecodeHeartbeatKey(t *testing.T) {
	if k, err := DecodeHeartbeatKey(""); k != nil || err != nil {
		t.Fatalf("empty: %v %v", k, err)
	}
	if _, err := DecodeHeartbeatKey("abcd"); err == nil {
		t.Fatal("a 2-byte key accepted")
	}
	if _, err := DecodeHeartbeatKey("not hex at all, not hex at all!!"); err == nil {
		t.Fatal("non-hex key accepted")
	}
	if k, err := DecodeHeartbeatKey(" " + strings.Repeat("ab", 16) + "\n"); err != nil || len(k) != 16 {
		t.Fatalf("16-byte key: %v %v", k, err)
	}
}

// FuzzVerifyHeartbeat: whatever the header, verification never panics and
// only the signature made with the key verifies.
func FuzzVerifyHeartbeat(f *testing.F) {
	key := []byte("0123456789abcdef")
	f.Add("kv.instances.p.a", []byte(`{}`), "v1="+strings.Repeat("0", 64))
	f.Add("kv.instances.p.a", []byte(`{}`), SignHeartbeat(key, "kv.instances.p.a", []byte(`{}`)))
	f.Add("", []byte{}, "")
	f.Fuzz(func(t *testing.T, subject string, data []byte, sig string) {
		h := nats.Header{}
		h.Set(HeaderSignature, sig)
		err := VerifyHeartbeat(key, subject, data, h)
		want := SignHeartbeat(key, subject, data)
		rest, ok := strings.CutPrefix(sig, "v1=")
		if (err == nil) != (ok && strings.EqualFold(rest, want[3:])) {
			t.Fatalf("verify(%q) = %v for subject %q", sig, err, subject)
		}
	})
}

// DecodeHeartbeatKey never panics; it accepts exactly the hex strings
// (spaces around allowed) of at least the minimum length and returns
// their bytes.
func FuzzDecodeHeartbeatKey(f *testing.F) {
	for _, s := range []string{"", "00", strings.Repeat("ab", MinHeartbeatKeyBytes), " " + strings.Repeat("AB", MinHeartbeatKeyBytes) + "\t", strings.Repeat("g0", MinHeartbeatKeyBytes)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := DecodeHeartbeatKey(s)
		trimmed := strings.TrimSpace(s)
		want, herr := hex.DecodeString(trimmed)
		switch {
		case trimmed == "":
			if b != nil || err != nil {
				t.Fatalf("%q: %x, %v; want no key", s, b, err)
			}
		case herr != nil || len(want) < MinHeartbeatKeyBytes:
			if err == nil {
				t.Fatalf("%q: accepted %x", s, b)
			}
		case err != nil || string(b) != string(want):
			t.Fatalf("%q: %x, %v; want %x", s, b, err, want)
		}
	})
}
