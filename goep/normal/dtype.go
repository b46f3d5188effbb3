package normal

import (
	"fmt"
	"math"
	"unsafe"
)

// DType is the element type of combine's x, bias and output.
type DType int

// Element types Combine reduces. The codes are the package's own; the
// caller maps torch dtypes to them.
const (
	BFloat16 DType = iota + 1
	Float16
	Float32
)

func (t DType) String() string {
	switch t {
	case BFloat16:
		return "bfloat16"
	case Float16:
		return "float16"
	case Float32:
		return "float32"
	}
	return fmt.Sprintf("dtype(%d)", int(t))
}

// Size is the element size in bytes (0 for an unknown type).
func (t DType) Size() int {
	switch t {
	case BFloat16, Float16:
		return 2
	case Float32:
		return 4
	}
	return 0
}

// BF16ToF32 widens a bfloat16 (exact).
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 rounds to the nearest bfloat16, ties to even; NaN stays NaN.
func F32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// F16ToF32 widens an IEEE half (exact, subnormals included).
func F16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch exp {
	case 0:
		f := float32(man) * (1.0 / (1 << 24)) // subnormal (or zero): man * 2^-24
		return math.Float32frombits(math.Float32bits(f) | sign)
	case 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

// F32ToF16 rounds to the nearest IEEE half, ties to even, overflowing to
// infinity and underflowing through subnormals to zero; NaN stays NaN.
func F32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 {
		// Subnormal half: the result is (man|implicit 1) >> (14-e), rounded.
		shift := uint32(14 - e)
		if shift > 24 {
			return sign
		}
		m := man | 0x800000
		r := m >> shift
		rem, half := m&(1<<shift-1), uint32(1)<<(shift-1)
		if rem > half || (rem == half && r&1 == 1) {
			r++
		}
		return sign | uint16(r)
	}
	r := uint32(e)<<10 | man>>13
	if rem := man & 0x1fff; rem > 0x1000 || (rem == 0x1000 && r&1 == 1) {
		r++ // a carry into the exponent is the correct result (up to infinity)
	}
	return sign | uint16(r)
}

// addRow adds n elements of type t at p to acc in float32.
func addRow(acc []float32, p unsafe.Pointer, t DType) {
	switch t {
	case BFloat16:
		src := unsafe.Slice((*uint16)(p), len(acc))
		for i, v := range src {
			acc[i] += math.Float32frombits(uint32(v) << 16)
		}
	case Float16:
		src := unsafe.Slice((*uint16)(p), len(acc))
		for i, v := range src {
			acc[i] += F16ToF32(v)
		}
	case Float32:
		src := unsafe.Slice((*float32)(p), len(acc))
		for i, v := range src {
			acc[i] += v
		}
	}
}

// storeRow rounds acc once to type t at p.
func storeRow(p unsafe.Pointer, acc []float32, t DType) {
	switch t {
	case BFloat16:
		dst := unsafe.Slice((*uint16)(p), len(acc))
		for i, v := range acc {
			dst[i] = F32ToBF16(v)
		}
	case Float16:
		dst := unsafe.Slice((*uint16)(p), len(acc))
		for i, v := range acc {
			dst[i] = F32ToF16(v)
		}
	case Float32:
		copy(unsafe.Slice((*float32)(p), len(acc)), acc)
	}
}
