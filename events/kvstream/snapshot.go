package kvstream

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Snapshot is a bridge's block table for one instance, as of one point in
// the events stream. Batch is an ordinary encoded EventBatch of BlockStored
// events, parents first (then stores in slower tiers and removals from
// faster ones, so each block ends in its tier set); applying it to an empty
// instance reproduces the table through the same code path as live events.
// A consumer applies Batch, then the stream's messages for the instance
// with a stream sequence above StreamSeq.
type Snapshot struct {
	Pool      string    `json:"pool"`
	Instance  string    `json:"instance"`
	Model     string    `json:"model,omitempty"`
	BlockSize int       `json:"block_size,omitempty"`
	Blocks    int       `json:"blocks"`
	EngineSeq uint64    `json:"engine_seq"`
	HasSeq    bool      `json:"has_seq"`
	StreamSeq uint64    `json:"stream_seq"`
	Taken     time.Time `json:"taken"`
	// EngineStart and LastHash identify the engine process the table
	// belongs to, so that a restarted bridge republishes it only for that
	// same process: the process's start time (Unix seconds, 0 unknown) and
	// the xxhash64 of the payload of message EngineSeq, which the engine's
	// replay buffer returns unchanged while it still holds it.
	EngineStart float64 `json:"engine_start,omitempty"`
	LastHash    uint64  `json:"last_hash,omitempty"`
	// Object, when set, says the full snapshot is too large for one NATS
	// message and sits in the snapshot object store under this name; this
	// one is then only a pointer (no Batch). See ResolveSnapshot.
	Object string `json:"object,omitempty"`
	// Batch is the encoded EventBatch (not part of the JSON header).
	Batch []byte `json:"-"`
}

// snapshotMagic starts every marshalled snapshot, so a stray value in the
// bucket or a reply from something else is rejected, not misread.
const snapshotMagic = "KVSNAP1\n"

// maxSnapshotHeader bounds the JSON header; real ones are ~300 bytes.
const maxSnapshotHeader = 64 << 10

// ErrBadSnapshot is returned by UnmarshalSnapshot for bytes that are not a
// snapshot.
var ErrBadSnapshot = errors.New("kvstream: malformed snapshot")

// MarshalBinary renders s as magic, uvarint header length, JSON header,
// then the raw batch bytes (kept binary: base64 would add a third).
func (s Snapshot) MarshalBinary() ([]byte, error) {
	hdr, err := json.Marshal(s)
	if err != nil {
		return nil, fmt.Errorf("kvstream: marshal snapshot header: %w", err)
	}
	out := make([]byte, 0, len(snapshotMagic)+binary.MaxVarintLen64+len(hdr)+len(s.Batch))
	out = append(out, snapshotMagic...)
	out = binary.AppendUvarint(out, uint64(len(hdr)))
	out = append(out, hdr...)
	return append(out, s.Batch...), nil
}

// UnmarshalSnapshot parses MarshalBinary's output. The returned Batch
// aliases b.
func UnmarshalSnapshot(b []byte) (Snapshot, error) {
	if !bytes.HasPrefix(b, []byte(snapshotMagic)) {
		return Snapshot{}, fmt.Errorf("%w: no %q prefix", ErrBadSnapshot, snapshotMagic[:len(snapshotMagic)-1])
	}
	b = b[len(snapshotMagic):]
	n, k := binary.Uvarint(b)
	if k <= 0 || n > maxSnapshotHeader || n > uint64(len(b)-k) {
		return Snapshot{}, fmt.Errorf("%w: bad header length", ErrBadSnapshot)
	}
	var s Snapshot
	if err := json.Unmarshal(b[k:k+int(n)], &s); err != nil {
		return Snapshot{}, fmt.Errorf("%w: header: %w", ErrBadSnapshot, err)
	}
	if s.Blocks < 0 || s.BlockSize < 0 {
		return Snapshot{}, fmt.Errorf("%w: negative counts", ErrBadSnapshot)
	}
	s.Batch = b[k+int(n):]
	return s, nil
}

// A read of a snapshot object is bounded by objectReadTimeout. nats.go
// gives a read whose context has no deadline its default API timeout
// (5 s) for the whole object, so a large snapshot on a busy server (a
// 192 MiB object took 5.3 s on loopback on a loaded 2-core machine,
// docs/transport.md "Snapshots") would fail at every try and the instance
// would never load; with no bound at all a read of chunks that never come
// (purged or lost under the reader) would hold the consumer shard or the
// bridge that asked. The bound is objectReadBase (that same API timeout)
// plus the object's size at objectReadFloor, a rate 15x below that loaded
// loopback read, so a healthy read is not cut and a stalled one is given
// up (and retried by the caller) after 5 s plus 0.5 s per MiB.
var objectReadBase = 5 * time.Second

const objectReadFloor = 2 << 20 // bytes per second

func objectReadTimeout(size uint64) time.Duration {
	return objectReadBase + time.Duration(float64(size)/objectReadFloor*float64(time.Second))
}

// ResolveSnapshot follows a pointer snapshot (Object set) to the full one
// in the object store; other snapshots are returned as they are. The object
// may have been replaced by a newer snapshot since the pointer was written;
// newer is as good (its StreamSeq says where the stream resumes).
func ResolveSnapshot(ctx context.Context, obs jetstream.ObjectStore, s Snapshot) (Snapshot, error) {
	if s.Object == "" {
		return s, nil
	}
	if obs == nil {
		return Snapshot{}, fmt.Errorf("%w: %s points to object %q but there is no object store", ErrBadSnapshot, s.Instance, s.Object)
	}
	ictx, cancel := context.WithTimeout(ctx, objectReadBase)
	info, err := obs.GetInfo(ictx, s.Object)
	cancel()
	if err != nil {
		return Snapshot{}, fmt.Errorf("kvstream: snapshot object %s: %w", s.Object, err)
	}
	rctx, cancel := context.WithTimeout(ctx, objectReadTimeout(info.Size))
	data, err := obs.GetBytes(rctx, s.Object)
	cancel()
	if err != nil {
		return Snapshot{}, fmt.Errorf("kvstream: snapshot object %s (%d bytes): %w", s.Object, info.Size, err)
	}
	full, err := UnmarshalSnapshot(data)
	if err != nil {
		return Snapshot{}, err
	}
	if full.Object != "" || full.Pool != s.Pool || full.Instance != s.Instance || full.StreamSeq < s.StreamSeq {
		return Snapshot{}, fmt.Errorf("%w: object %s holds %s/%s at stream seq %d, pointer says %s/%s at %d",
			ErrBadSnapshot, s.Object, full.Pool, full.Instance, full.StreamSeq, s.Pool, s.Instance, s.StreamSeq)
	}
	return full, nil
}
