package events

import (
	"encoding/binary"
	"fmt"
	"math"
)

// reader is a bounds-checked msgpack cursor over one payload. It never
// allocates: strings and binaries are returned as sub-slices of the input,
// and every length it reports has been checked against the bytes that remain
// (each msgpack element takes at least one byte), so callers may size
// allocations from it without trusting the sender.
type reader struct {
	b   []byte
	off int
}

// msgpack type classes as seen by peek.
type mpType uint8

const (
	mpInvalid mpType = iota
	mpNil
	mpBool
	mpInt
	mpFloat
	mpStr
	mpBin
	mpArray
	mpMap
	mpExt
)

var mpTypeNames = [...]string{"invalid", "nil", "bool", "int", "float", "str", "bin", "array", "map", "ext"}

func (t mpType) String() string {
	if int(t) < len(mpTypeNames) {
		return mpTypeNames[t]
	}
	return "invalid"
}

func typeOf(c byte) mpType {
	switch {
	case c <= 0x7f || c >= 0xe0:
		return mpInt
	case c <= 0x8f:
		return mpMap
	case c <= 0x9f:
		return mpArray
	case c <= 0xbf:
		return mpStr
	}
	switch c {
	case 0xc0:
		return mpNil
	case 0xc2, 0xc3:
		return mpBool
	case 0xc4, 0xc5, 0xc6:
		return mpBin
	case 0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return mpExt
	case 0xca, 0xcb:
		return mpFloat
	case 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3:
		return mpInt
	case 0xd9, 0xda, 0xdb:
		return mpStr
	case 0xdc, 0xdd:
		return mpArray
	case 0xde, 0xdf:
		return mpMap
	}
	return mpInvalid // 0xc1 is never used
}

func (r *reader) remaining() int { return len(r.b) - r.off }

// peek returns the type of the next element without consuming it.
func (r *reader) peek() (mpType, error) {
	if r.off >= len(r.b) {
		return mpInvalid, errTruncated
	}
	return typeOf(r.b[r.off]), nil
}

// peekByte returns the next marker byte (the caller has checked there is one).
func (r *reader) peekByte() byte { return r.b[r.off] }

func (r *reader) need(n int) error {
	if n < 0 || r.remaining() < n {
		return errTruncated
	}
	return nil
}

// take consumes the next n bytes and returns them, aliasing the payload
// (capped, so that an append to them cannot write into it).
func (r *reader) take(n int) ([]byte, error) {
	if err := r.need(n); err != nil {
		return nil, err
	}
	s := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return s, nil
}

func (r *reader) u8() uint8 { v := r.b[r.off]; r.off++; return v }
func (r *reader) u16() uint16 {
	v := binary.BigEndian.Uint16(r.b[r.off:])
	r.off += 2
	return v
}
func (r *reader) u32() uint32 {
	v := binary.BigEndian.Uint32(r.b[r.off:])
	r.off += 4
	return v
}
func (r *reader) u64() uint64 {
	v := binary.BigEndian.Uint64(r.b[r.off:])
	r.off += 8
	return v
}

// readNil consumes a nil if the next element is one and reports whether it did.
func (r *reader) readNil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// length reads a size prefix of w bytes (1, 2 or 4).
func (r *reader) length(w int) (int, error) {
	if err := r.need(w); err != nil {
		return 0, err
	}
	switch w {
	case 1:
		return int(r.u8()), nil
	case 2:
		return int(r.u16()), nil
	default:
		return int(r.u32()), nil
	}
}

// arrayHeader reads an array header. The count is checked against the
// remaining bytes (minElem bytes per element at least), so a claimed length
// of billions fails here instead of in an allocation.
func (r *reader) arrayHeader(minElem int) (int, error) {
	return r.header(0x90, 0xdc, 0xdd, max(minElem, 1), "array", "elements")
}

// mapHeader reads a map header; each entry takes at least two bytes.
func (r *reader) mapHeader() (int, error) {
	return r.header(0x80, 0xde, 0xdf, 2, "map", "entries")
}

// header reads the header of an array or a map, whose forms are the fix
// form fix..fix+0x0f (the count in the low nibble) and 16- and 32-bit
// counts after the bytes b16 and b32; a count of more items than the
// remaining bytes can hold at minItem bytes each is truncated input.
func (r *reader) header(fix, b16, b32 byte, minItem int, kind, items string) (int, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	c := r.b[r.off]
	var n int
	var err error
	switch {
	case c >= fix && c <= fix|0x0f:
		r.off++
		n = int(c & 0x0f)
	case c == b16:
		r.off++
		n, err = r.length(2)
	case c == b32:
		r.off++
		n, err = r.length(4)
	default:
		return 0, wrongType(kind, c)
	}
	if err != nil {
		return 0, err
	}
	if uint64(n)*uint64(minItem) > uint64(r.remaining()) { // n > remaining/minItem, without a division
		return 0, fmt.Errorf("%s of %d %s in %d bytes: %w", kind, n, items, r.remaining(), errTruncated)
	}
	return n, nil
}

// readInt reads any msgpack integer. neg reports a negative value (v is then
// its two's complement).
func (r *reader) readInt() (v uint64, neg bool, err error) {
	if r.off >= len(r.b) {
		return 0, false, errTruncated
	}
	c := r.b[r.off]
	switch {
	case c <= 0x7f:
		r.off++
		return uint64(c), false, nil
	case c >= 0xe0:
		r.off++
		return uint64(int64(int8(c))), true, nil
	}
	var w int
	switch c {
	case 0xcc, 0xd0:
		w = 1
	case 0xcd, 0xd1:
		w = 2
	case 0xce, 0xd2:
		w = 4
	case 0xcf, 0xd3:
		w = 8
	default:
		return 0, false, wrongType("int", c)
	}
	if err := r.need(1 + w); err != nil {
		return 0, false, err
	}
	r.off++
	signed := c >= 0xd0
	switch w {
	case 1:
		if signed {
			v = uint64(int64(int8(r.u8())))
		} else {
			v = uint64(r.u8())
		}
	case 2:
		if signed {
			v = uint64(int64(int16(r.u16())))
		} else {
			v = uint64(r.u16())
		}
	case 4:
		if signed {
			v = uint64(int64(int32(r.u32())))
		} else {
			v = uint64(r.u32())
		}
	default:
		v = r.u64()
	}
	return v, signed && int64(v) < 0, nil
}

// readFloat reads a float32/float64 (or, leniently, an integer) as float64.
// f32 reports a float32 on the wire.
func (r *reader) readFloat() (f float64, f32 bool, err error) {
	if r.off >= len(r.b) {
		return 0, false, errTruncated
	}
	switch c := r.b[r.off]; c {
	case 0xca:
		if err := r.need(5); err != nil {
			return 0, false, err
		}
		r.off++
		return float64(math.Float32frombits(r.u32())), true, nil
	case 0xcb:
		if err := r.need(9); err != nil {
			return 0, false, err
		}
		r.off++
		return math.Float64frombits(r.u64()), false, nil
	default:
		if typeOf(c) != mpInt {
			return 0, false, wrongType("float", c)
		}
		v, neg, err := r.readInt()
		if err != nil {
			return 0, false, err
		}
		if neg {
			return float64(int64(v)), false, nil
		}
		return float64(v), false, nil
	}
}

// readStr returns the bytes of a string, aliasing the payload.
func (r *reader) readStr() ([]byte, error) {
	if r.off >= len(r.b) {
		return nil, errTruncated
	}
	c := r.b[r.off]
	var n int
	var err error
	switch {
	case c >= 0xa0 && c <= 0xbf:
		r.off++
		n = int(c & 0x1f)
	case c == 0xd9:
		r.off++
		n, err = r.length(1)
	case c == 0xda:
		r.off++
		n, err = r.length(2)
	case c == 0xdb:
		r.off++
		n, err = r.length(4)
	default:
		return nil, wrongType("str", c)
	}
	if err != nil {
		return nil, err
	}
	return r.take(n)
}

// readBin returns the bytes of a bin, aliasing the payload.
func (r *reader) readBin() ([]byte, error) {
	if r.off >= len(r.b) {
		return nil, errTruncated
	}
	var w int
	switch c := r.b[r.off]; c {
	case 0xc4:
		w = 1
	case 0xc5:
		w = 2
	case 0xc6:
		w = 4
	default:
		return nil, wrongType("bin", c)
	}
	r.off++
	n, err := r.length(w)
	if err != nil {
		return nil, err
	}
	return r.take(n)
}

// skip consumes one complete element of any type. It is iterative: it keeps
// a count of elements still owed instead of recursing, so deep nesting costs
// no stack, and every step consumes at least one byte, so it ends within
// len(payload) steps whatever the headers claim.
func (r *reader) skip() error {
	owed := 1
	for owed > 0 {
		if r.off >= len(r.b) {
			return errTruncated
		}
		c := r.b[r.off]
		owed--
		switch typeOf(c) {
		case mpNil, mpBool:
			r.off++
		case mpInt, mpFloat:
			var w int
			switch {
			case c <= 0x7f || c >= 0xe0:
				w = 0
			case c == 0xcc || c == 0xd0:
				w = 1
			case c == 0xcd || c == 0xd1:
				w = 2
			case c == 0xce || c == 0xd2 || c == 0xca:
				w = 4
			default:
				w = 8
			}
			if err := r.need(1 + w); err != nil {
				return err
			}
			r.off += 1 + w
		case mpStr:
			if _, err := r.readStr(); err != nil {
				return err
			}
		case mpBin:
			if _, err := r.readBin(); err != nil {
				return err
			}
		case mpArray:
			n, err := r.arrayHeader(1)
			if err != nil {
				return err
			}
			owed += n
		case mpMap:
			n, err := r.mapHeader()
			if err != nil {
				return err
			}
			owed += 2 * n
		case mpExt:
			// fixext: marker, type byte, 1..16 data bytes;
			// ext 8/16/32: marker, length, type byte, data.
			if c >= 0xd4 && c <= 0xd8 {
				n := 1 << (c - 0xd4)
				if err := r.need(2 + n); err != nil {
					return err
				}
				r.off += 2 + n
				break
			}
			r.off++
			n, err := r.length(1 << (c - 0xc7))
			if err != nil {
				return err
			}
			if err := r.need(1 + n); err != nil {
				return err
			}
			r.off += 1 + n
		default:
			return fmt.Errorf("reserved marker 0x%02x: %w", c, ErrMalformed)
		}
	}
	return nil
}
