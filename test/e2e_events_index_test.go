package test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/tiers"
)

// The full path into the router's real index, both backends: ZMQ publisher
// → kvbridge → JetStream → consumer → kvindex; a lookup of a request's key
// chain sees its stored blocks, then their removal.
func TestE2EIndexLookup(t *testing.T) {
	backends := []struct {
		name string
		make func(t *testing.T) kvindex.Index
	}{
		{"memory", func(t *testing.T) kvindex.Index {
			ix, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "fake-model"})
			if err != nil {
				t.Fatal(err)
			}
			return ix
		}},
		{"redis", func(t *testing.T) kvindex.Index {
			rc := redis.NewClient(&redis.Options{Addr: testenv.Redis(t)})
			t.Cleanup(func() { _ = rc.Close() })
			ix, err := kvindex.NewRedis(rc, kvindex.RedisConfig{Prefix: testenv.UniqueName(t), Model: "fake-model", TTL: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			return ix
		}},
	}
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			ps := eventstest.CapturedPayloads(t, "array.jsonl")
			first, err := events.Decode(ps[0])
			if err != nil {
				t.Fatal(err)
			}
			chatA := first.Events[0] // chat_A: 12 blocks from block 0
			if chatA.HasParent || len(chatA.BlockHashes) != 12 {
				t.Fatalf("capture changed: %+v", chatA)
			}
			keys := kvindex.Keys(kvindex.Root("fake-model", "", ""), chatA.TokenIDs, 16)

			ix := be.make(t)
			r := newRig(t, rigOpts{})
			c, _ := r.runConsumer(consumer.Config{Applier: ix})

			gpuBlocks := func() int {
				ms, err := ix.Lookup(r.ctx, keys)
				if err != nil {
					t.Fatal(err)
				}
				for _, m := range ms {
					if m.Instance == r.instance {
						return m.Blocks[tiers.GPU]
					}
				}
				return 0
			}
			r.publish(ps[0])
			testenv.WaitFor(t, 20*time.Second, "chat_A's 12 blocks in the index", func() bool { return gpuBlocks() == 12 })

			// The fills evict blocks of chat_A (the capture's BlockRemoved):
			// the lookup sees the chain cut at the first evicted block.
			r.publish(ps[1:22]...)
			engine := reference(t, ps[:22]...)
			lead := 0
			for _, h := range chatA.BlockHashes {
				if _, ok := engine[h]; !ok {
					break
				}
				lead++
			}
			if lead == 12 {
				t.Fatal("capture changed: chat_A not evicted by seq 22")
			}
			testenv.WaitFor(t, 20*time.Second, "chat_A's removals in the index", func() bool { return gpuBlocks() == lead })
			r.publish(ps[22])
			r.waitPublished(23)
			testenv.WaitFor(t, 20*time.Second, "consumer at the bridge's position", func() bool {
				st := c.Instances()
				return len(st) == 1 && st[0].LastSeq == 23
			})
			// seq 23 stores chat_A again (12 blocks), so it is whole again.
			if n := gpuBlocks(); n != 12 {
				t.Fatalf("after re-store: %d GPU blocks, want 12", n)
			}
			r.publish(ps[23]) // AllBlocksCleared (sleep)
			testenv.WaitFor(t, 20*time.Second, "chat_A cleared from the index", func() bool { return gpuBlocks() == 0 })
		})
	}
}

// A router that starts late, with a stream that kept only the last 4
// messages, rebuilds the real index from the bridge's snapshot: every
// captured request's chain looks up the same as in a router that never
// stopped (the capture evicts parents before children, so this also checks
// that such children survive a snapshot).
func TestE2EIndexRouterRestart(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "map.jsonl")
	r := newRig(t, rigOpts{maxMsgs: 4})
	run := func(ix kvindex.Index) *consumer.Consumer {
		c, _ := r.runConsumer(consumer.Config{Applier: ix})
		return c
	}
	newIx := func() *kvindex.Memory {
		ix, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "fake-model"})
		if err != nil {
			t.Fatal(err)
		}
		return ix
	}
	steady := newIx()
	cs := run(steady)
	r.publishFollowed(cs, ps[:23]...)
	r.waitPublished(23)
	testenv.WaitFor(t, 20*time.Second, "steady consumer at seq 23", func() bool {
		st := cs.Instances()
		return len(st) == 1 && st[0].LastSeq == 23
	})
	late := newIx()
	cl := run(late)
	testenv.WaitFor(t, 20*time.Second, "late consumer loaded", func() bool {
		st := cl.Instances()
		return len(st) == 1 && st[0].SnapshotSeq > 0
	})

	// Every chain stored in the capture, looked up in both.
	var chains [][]kvindex.Key
	for _, p := range ps[:23] {
		b, _ := events.Decode(p)
		for _, e := range b.Events {
			if e.Kind == events.BlockStored && !e.HasParent && len(e.TokenIDs) > 0 {
				root := kvindex.Root("fake-model", e.LoraName, e.CacheSalt)
				chains = append(chains, kvindex.Keys(root, e.TokenIDs, e.BlockSize))
			}
		}
	}
	if len(chains) < 5 {
		t.Fatalf("only %d chains in the capture", len(chains))
	}
	for i, keys := range chains {
		a, err := steady.Lookup(r.ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		b, err := late.Lookup(r.ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		if len(a) != len(b) || (len(a) == 1 && a[0].Blocks != b[0].Blocks) {
			t.Fatalf("chain %d: steady %+v, rebuilt %+v", i, a, b)
		}
	}
	sa, _ := steady.Instances(r.ctx)
	sb, _ := late.Instances(r.ctx)
	if len(sa) != 1 || len(sb) != 1 || sa[0].Blocks != sb[0].Blocks {
		t.Fatalf("instance stats steady %+v rebuilt %+v", sa, sb)
	}
}
