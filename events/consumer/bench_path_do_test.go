//go:build unix

package consumer

import (
	"context"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

var pathDec events.Decoder

// pathDo runs one queued piece of work as a shard does (the old tree's
// copy of this file calls c.do(ctx, w)).
func pathDo(ctx context.Context, c *Consumer, w work) { c.do(ctx, w, &pathDec) }

// pathDispatch hands m to dispatch as deliver does (the old tree's copy
// calls c.dispatch(ctx, m)).
func pathDispatch(ctx context.Context, c *Consumer, m *pathMsg) {
	c.dispatch(ctx, m, parseAckReply(m.Reply()), time.Now())
}
