package events_test

import (
	"fmt"

	"github.com/kvrouter/kvrouter/events"
)

// A batch built by hand encodes to the form current vLLM sends, and decodes
// back to the same events.
func ExampleEncode() {
	b := events.Batch{
		TS: 1795942766.5,
		Events: []events.Event{{
			Kind:        events.BlockStored,
			BlockHashes: []uint64{0x1cbb38b3ef99565b},
			TokenIDs:    []uint32{1, 2, 3, 4},
			BlockSize:   4,
			Medium:      "GPU",
			CacheSalt:   "tenant-a",
		}},
		DPRank: 0, HasDPRank: true,
	}
	p, err := events.Encode(nil, b, events.EncodingMap)
	if err != nil {
		panic(err)
	}
	got, err := events.Decode(p)
	if err != nil {
		panic(err)
	}
	e := got.Events[0]
	fmt.Println(got.Encoding, e.Kind, len(e.BlockHashes), e.TokenIDs, e.CacheSalt, e.FullAttention())
	// Output: map BlockStored 1 [1 2 3 4] tenant-a true
}
