package lowlatency

import "encoding/binary"

// LogFMT-10 is the combine's row format with use_logfmt (DeepEP's "LogFMT with a dynamic cast",
// 10 bits a value): a row of H bf16 values, H a multiple of LogGroup, travels as H/LogGroup
// groups of LogGroup channels, in LogFMTBytes(H) bytes, at most the 2H of the bf16 row:
//
//	meta  [G]uint32   group g's bmin | bmax << 16 (see below)
//	codes [G][160]byte group g's values, value i at bit 10i (little-endian): its code | sign << 9
//
// In a group the magnitudes are bf16 bit patterns m = bits & 0x7fff, which grow with the value and
// step by about 1/128 of an octave: bmax is the largest finite one (0 if none), bmin the smallest
// non-zero finite one, raised to bmax - LogClip (32 octaves below bmax), D = bmax - bmin. A finite m in [bmin, bmax] gets code 1 + round((m - bmin) * 509 / D)
// (1 if D = 0), and decodes to bmin + round((code - 1) * D / 509): the same bf16 when D <= 509 (a
// group within about 4 octaves travels exactly), else within D / 1018 + 1/2 steps of it (at most
// 4.5 steps, 2-4% of the value, over the full 32 octaves). A value below bmin gets 1 within an
// octave of it (128 steps), else 0 (decoding to zero, its sign kept), as a zero does; an infinity
// or NaN gets 511 (decoding to an infinity of its sign). Integer arithmetic only, so the cpu
// engine and the GPU kernels (kernels/low_latency_combine.cuh) agree bit for bit.
const (
	// LogGroup is the channels of a LogFMT group.
	LogGroup = 128
	// LogClip is the magnitudes a group spans at most: 32 octaves of 128 bf16 steps.
	LogClip = 32 * 128
	// logLevels is the steps between the least and the largest code of a group's range.
	logLevels  = 509
	logInf     = 511
	logGroupB  = LogGroup * 10 / 8 // a group's codes, bytes
	bf16MagInf = 0x7f80
)

// LogFMTBytes is the bytes of a LogFMT-10 row of hidden channels.
func LogFMTBytes(hidden int) int { return hidden / LogGroup * (4 + logGroupB) }

// logRange is a group's (bmin, bmax) from its values.
func logRange(g []uint16) (bmin, bmax uint16) {
	bmin = 0xffff
	for _, v := range g {
		if m := v & 0x7fff; m < bf16MagInf {
			bmax = max(bmax, m)
			if m != 0 {
				bmin = min(bmin, m)
			}
		}
	}
	if bmin == 0xffff {
		return 0, bmax
	}
	if int(bmax)-int(bmin) > LogClip {
		bmin = bmax - LogClip
	}
	return bmin, bmax
}

// logCode is the code of magnitude m in a group of (bmin, bmax).
func logCode(m, bmin, bmax uint16) uint32 {
	switch {
	case m >= bf16MagInf:
		return logInf
	case m == 0 || m+128 < bmin: // zero, or more than an octave below the least level
		return 0
	case m < bmin:
		return 1
	}
	d := uint32(bmax - bmin)
	if d == 0 {
		return 1
	}
	return 1 + (uint32(m-bmin)*2*logLevels+d)/(2*d)
}

// logValue is the magnitude that code c decodes to in a group of (bmin, bmax).
func logValue(c uint32, bmin, bmax uint16) uint16 {
	switch c {
	case 0:
		return 0
	case logInf:
		return bf16MagInf
	}
	d := uint32(bmax - bmin)
	return bmin + uint16(((c-1)*d*2+logLevels)/(2*logLevels))
}

// EncodeLogFMT writes row (H bf16, H a multiple of LogGroup) into dst, LogFMTBytes(H) bytes.
func EncodeLogFMT(dst []byte, row []uint16) {
	G := len(row) / LogGroup
	for g := range G {
		vals := row[g*LogGroup : (g+1)*LogGroup]
		bmin, bmax := logRange(vals)
		binary.LittleEndian.PutUint32(dst[4*g:], uint32(bmin)|uint32(bmax)<<16)
		codes := dst[4*G+g*logGroupB : 4*G+(g+1)*logGroupB]
		clear(codes)
		for i, v := range vals {
			o, s := 10*i/8, 10*i%8 // s is 0, 2, 4 or 6: a field lies in 2 bytes
			f := (logCode(v&0x7fff, bmin, bmax) | uint32(v>>15)<<9) << s
			codes[o] |= byte(f)
			codes[o+1] |= byte(f >> 8)
		}
	}
}

// DecodeLogFMT reads a LogFMT-10 row of len(row) channels from src into row (bf16).
func DecodeLogFMT(row []uint16, src []byte) {
	G := len(row) / LogGroup
	for g := range G {
		meta := binary.LittleEndian.Uint32(src[4*g:])
		bmin, bmax := uint16(meta), uint16(meta>>16)
		codes := src[4*G+g*logGroupB : 4*G+(g+1)*logGroupB]
		for i := range LogGroup {
			o, s := 10*i/8, 10*i%8
			f := (uint32(codes[o]) | uint32(codes[o+1])<<8) >> s & 0x3ff
			row[g*LogGroup+i] = logValue(f&0x1ff, bmin, bmax) | uint16(f>>9)<<15
		}
	}
}
