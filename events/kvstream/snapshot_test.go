package kvstream

import (
	"bytes"
	"errors"
	"reflect"
	"testing"
	"time"
)

func TestSnapshotRoundTrip(t *testing.T) {
	tests := []Snapshot{
		{},
		{Pool: "p", Instance: "i", Model: "m", BlockSize: 16, Blocks: 3, EngineSeq: 42, HasSeq: true, StreamSeq: 7,
			Taken: time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC), Batch: []byte{0x93, 0xcb, 1, 2, 3}},
	}
	for _, s := range tests {
		b, err := s.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		got, err := UnmarshalSnapshot(b)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Batch, s.Batch) {
			t.Fatalf("batch %x != %x", got.Batch, s.Batch)
		}
		got.Batch, s.Batch = nil, nil
		if !got.Taken.Equal(s.Taken) {
			t.Fatalf("taken %v != %v", got.Taken, s.Taken)
		}
		got.Taken, s.Taken = time.Time{}, time.Time{}
		if !reflect.DeepEqual(got, s) {
			t.Fatalf("got %+v want %+v", got, s)
		}
	}
}

func TestUnmarshalSnapshotRejects(t *testing.T) {
	good, _ := Snapshot{Pool: "p"}.MarshalBinary()
	for name, b := range map[string][]byte{
		"empty":        nil,
		"no magic":     []byte("hello"),
		"magic only":   []byte(snapshotMagic),
		"huge length":  append([]byte(snapshotMagic), 0xff, 0xff, 0xff, 0xff, 0x0f),
		"short header": good[:len(snapshotMagic)+3],
		"bad json":     append([]byte(snapshotMagic), 2, '{', '{'),
		"neg blocks":   append(append([]byte(snapshotMagic), 13), `{"blocks":-1}`...),
	} {
		if _, err := UnmarshalSnapshot(b); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("%s: err = %v, want ErrBadSnapshot", name, err)
		}
	}
}

func FuzzUnmarshalSnapshot(f *testing.F) {
	good, _ := Snapshot{Pool: "p", Instance: "i", Blocks: 1, Batch: []byte{1, 2}}.MarshalBinary()
	f.Add(good)
	f.Add([]byte(snapshotMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := UnmarshalSnapshot(b)
		if err != nil {
			return
		}
		again, err := s.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		s2, err := UnmarshalSnapshot(again)
		if err != nil {
			t.Fatalf("re-marshalled snapshot does not parse: %v", err)
		}
		if !bytes.Equal(s2.Batch, s.Batch) || s2.Pool != s.Pool || s2.StreamSeq != s.StreamSeq {
			t.Fatal("round trip changed the snapshot")
		}
	})
}
