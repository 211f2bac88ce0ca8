package kvstream

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// objectStoreForTest returns a memory object store of its own on a fresh
// embedded server.
func objectStoreForTest(t *testing.T) (jetstream.JetStream, jetstream.ObjectStore, string) {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	nc, err := nats.Connect(testenv.StartNATS(t).URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cfg := BucketConfig{Name: "B_" + testenv.UniqueName(t), Memory: true}
	obs, err := EnsureObjectStore(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return js, obs, cfg.ObjectStoreName()
}

// putPointer stores full in the object store and returns its pointer.
func putPointer(t *testing.T, obs jetstream.ObjectStore, full Snapshot) Snapshot {
	t.Helper()
	data, err := full.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	full.Object = full.Pool + "." + full.Instance
	if _, err := obs.PutBytes(testenv.Context(t, time.Minute), full.Object, data); err != nil {
		t.Fatal(err)
	}
	ptr := full
	ptr.Batch = nil
	return ptr
}

// A pointer to an intact object resolves to the full snapshot.
func TestResolveSnapshotObject(t *testing.T) {
	_, obs, _ := objectStoreForTest(t)
	full := Snapshot{Pool: "p", Instance: "i", Blocks: 3, StreamSeq: 9, Batch: bytes.Repeat([]byte{7}, 300<<10)}
	got, err := ResolveSnapshot(testenv.Context(t, time.Minute), obs, putPointer(t, obs, full))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Batch, full.Batch) || got.StreamSeq != 9 || got.Object != "" {
		t.Fatalf("resolved %d bytes at seq %d object %q, want %d at 9", len(got.Batch), got.StreamSeq, got.Object, len(full.Batch))
	}
}

// An object whose chunks are gone under the reader (its metadata still
// says it has bytes) fails within the read's bound instead of waiting
// forever, even when the caller's context has no deadline (nats.go polls
// such a read in 5 s steps without end).
func TestResolveSnapshotStalledObjectFails(t *testing.T) {
	js, obs, store := objectStoreForTest(t)
	ptr := putPointer(t, obs, Snapshot{Pool: "p", Instance: "i", Blocks: 3, StreamSeq: 9, Batch: bytes.Repeat([]byte{7}, 300<<10)})
	ctx := testenv.Context(t, time.Minute)
	info, err := obs.GetInfo(ctx, ptr.Object)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, "OBJ_"+store)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Purge(ctx, jetstream.WithPurgeSubject(fmt.Sprintf("$O.%s.C.%s", store, info.NUID))); err != nil {
		t.Fatal(err)
	}
	old := objectReadBase
	objectReadBase = 500 * time.Millisecond
	t.Cleanup(func() { objectReadBase = old })
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := ResolveSnapshot(context.Background(), obs, ptr)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a snapshot whose chunks are gone resolved")
		}
		t.Logf("failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(30 * time.Second):
		t.Fatal("the read of a stalled object did not end in 30 s")
	}
}

// BenchmarkResolveSnapshotObject reads a 64 MiB snapshot object (a
// snapshot of ~700,000 blocks) from an embedded server on loopback.
func BenchmarkResolveSnapshotObject(b *testing.B) {
	ctx := context.Background()
	nc, err := nats.Connect(testenv.StartNATS(b).URL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	obs, err := EnsureObjectStore(ctx, js, BucketConfig{Name: "B_bench", Memory: true})
	if err != nil {
		b.Fatal(err)
	}
	full := Snapshot{Pool: "p", Instance: "i", Blocks: 1, Batch: bytes.Repeat([]byte{7}, 64<<20)}
	data, _ := full.MarshalBinary()
	if _, err := obs.PutBytes(ctx, "p.i", data); err != nil {
		b.Fatal(err)
	}
	ptr := full
	ptr.Batch, ptr.Object = nil, "p.i"
	b.SetBytes(int64(len(data)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := ResolveSnapshot(ctx, obs, ptr); err != nil {
			b.Fatal(err)
		}
	}
}
