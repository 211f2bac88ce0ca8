package events

import "fmt"

// SplitValues splits payload, the concatenation of exactly n msgpack
// values (engine batches joined unchanged by a coalescing kvbridge), into
// those values, appended to dst[:0]; each part aliases payload. Values
// are self-delimiting, so no lengths travel beside them. It checks only
// that each value is complete msgpack (its contents are Decode's
// business) and that nothing follows the n-th; any other shape returns
// no values and an error wrapping ErrMalformed, so that no caller can
// apply part of a message that is not what its headers say. n must be at
// least 1.
func SplitValues(payload []byte, n int, dst [][]byte) ([][]byte, error) {
	dst = dst[:0]
	if n < 1 {
		return dst, fmt.Errorf("%w: %d values wanted", ErrMalformed, n)
	}
	r := reader{b: payload}
	for i := 0; i < n; i++ {
		start := r.off
		if r.remaining() == 0 {
			return dst[:0], fmt.Errorf("%w: %d of %d values present", ErrMalformed, i, n)
		}
		if err := r.skip(); err != nil {
			return dst[:0], fmt.Errorf("%w: value %d of %d at byte %d: %w", ErrMalformed, i+1, n, start, err)
		}
		dst = append(dst, payload[start:r.off:r.off])
	}
	if r.remaining() != 0 {
		return dst[:0], fmt.Errorf("%w: %d trailing bytes after %d values", ErrMalformed, r.remaining(), n)
	}
	return dst, nil
}
