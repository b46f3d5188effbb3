package lowlatency

import "math"

// The number conversions of the low-latency kernels, bit for bit: BF16 <-> float32 with
// round-to-nearest-even, and DeepEP's per-128-channel FP8 (e4m3) cast.

const (
	fp8Margin  = float32(1e-4) // the least amax, so that a zero block has a finite scale
	fp8Max     = float32(448)  // e4m3's largest finite value
	fp8MaxBits = 0x7e
)

// fp8MaxInv is 1/448 as a float32: the scale's inverse is amax times it, as DeepEP computes.
var fp8MaxInv = float32(1) / fp8Max

func bf16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

func f32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it quiet
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// fp8Scales returns the factor that maps a block of amax onto e4m3's range and its inverse,
// the scale stored with the block; with round, both are powers of two (the inverse rounded up).
func fp8Scales(amax float32, round bool) (scale, inv float32) {
	if round {
		bits := math.Float32bits(amax * fp8MaxInv)
		exp := int(bits>>23&0xff) - 127
		if bits&(1<<23-1) != 0 {
			exp++
		}
		return math.Float32frombits(uint32(127-exp) << 23), math.Float32frombits(uint32(127+exp) << 23)
	}
	return fp8Max / amax, amax * fp8MaxInv
}

// toE4M3 converts with round-to-nearest-even, saturating to ±448 (__NV_SATFINITE).
func toE4M3(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	u := b & 0x7fffffff
	switch {
	case u > 0x7f800000:
		return sign | 0x7f
	case u >= math.Float32bits(fp8Max):
		return sign | fp8MaxBits
	case u < 121<<23: // below 2^-6: a subnormal of e4m3, in steps of 2^-9
		return sign | uint8(math.RoundToEven(float64(math.Float32frombits(u))*512))
	}
	v := (u>>23-120)<<3 | u>>20&7
	rest := u & (1<<20 - 1)
	if rest > 1<<19 || rest == 1<<19 && v&1 == 1 {
		v++
	}
	return sign | uint8(v)
}

// ue8m0 is the exponent byte of a power-of-two scale.
func ue8m0(scale float32) uint8 { return uint8(math.Float32bits(scale) >> 23) }

// castFP8 writes token x (H bf16) as H e4m3 bytes into q and its H/128 scales into scales.
func castFP8(x []uint16, q []byte, scales []float32, round bool) {
	for blk := range scales {
		xs := x[blk*ScaleBlock : (blk+1)*ScaleBlock]
		amax := fp8Margin
		for _, h := range xs {
			amax = max(amax, float32(math.Abs(float64(bf16ToF32(h)))))
		}
		scale, inv := fp8Scales(amax, round)
		for i, h := range xs {
			q[blk*ScaleBlock+i] = toE4M3(float32(bf16ToF32(h) * scale))
		}
		scales[blk] = inv
	}
}
