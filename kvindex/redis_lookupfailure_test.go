package kvindex

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"
)

func TestLookupFailure(t *testing.T) {
	tests := []struct {
		err  error
		want string
	}{
		{context.DeadlineExceeded, "timeout"},
		{fmt.Errorf("kvindex: lookup: %w", context.DeadlineExceeded), "timeout"},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, "timeout"},
		{context.Canceled, "canceled"},
		{fmt.Errorf("wrapped: %w", context.Canceled), "canceled"},
		{errors.New("CLUSTERDOWN The cluster is down"), "error"},
		{&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, "error"},
	}
	for _, tt := range tests {
		if got := LookupFailure(tt.err); got != tt.want {
			t.Errorf("LookupFailure(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
}
