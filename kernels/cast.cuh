// cast.cuh: low-latency mode's float arithmetic that must match goep/lowlatency bit for bit: a
// product never fused into an add, and the cast of a BF16 row to FP8 e4m3 with its scale (amax
// onto 448, or with kRound a power of two, as UE8M0 stores it).
#pragma once

#ifdef PYEP_EMU
#include "emu.h"
#else
#include "utils.cuh"
#endif

namespace pyep {

// A product rounded to nearest, never fused into an add (goep/lowlatency's casts and sums do the same).
PYEP_DEVICE float mul_rn(float a, float b) {
#ifdef PYEP_EMU
    volatile float r = a * b;
    return r;
#else
    return __fmul_rn(a, b);
#endif
}

#ifdef PYEP_EMU
// e4m3, rounding to nearest even and saturating at 448: the GPU's cvt.rn.satfinite.e4m3x2 (utils.cuh),
// which the emulator has not.
PYEP_DEVICE u8 to_e4m3(float f) {
    const u32 b = __float_as_uint(f), u = b & 0x7fffffffu;
    const u8 sign = static_cast<u8>((b >> 24) & 0x80u);
    if (u > 0x7f800000u) return sign | 0x7f;
    if (u >= 0x43e00000u) return sign | 0x7e;  // >= 448: saturate
    if (u < (121u << 23)) {                    // e4m3 subnormal: steps of 2^-9
        const float s = __uint_as_float(u) * 512.0f;
        u32 i = static_cast<u32>(s);
        const float fr = s - static_cast<float>(i);
        if (fr > 0.5f || (fr == 0.5f && (i & 1u))) i++;
        return sign | static_cast<u8>(i);
    }
    u32 v = (((u >> 23) - 120u) << 3) | ((u >> 20) & 7u);
    const u32 rest = u & ((1u << 20) - 1u);
    if (rest > (1u << 19) || (rest == (1u << 19) && (v & 1u))) v++;
    return sign | static_cast<u8>(v);
}
#endif

// The factor that maps amax onto e4m3's range, and its inverse (the stored scale).
template <bool kRound>
PYEP_DEVICE void fp8_scales(float amax, float& scale, float& inv) {
    const float max_inv = 1.0f / 448.0f;
    if (kRound) {
        const u32 bits = __float_as_uint(mul_rn(amax, max_inv));
        int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
        if ((bits & ((1u << 23) - 1u)) != 0) e++;
        scale = __uint_as_float(static_cast<u32>(127 - e) << 23);
        inv = __uint_as_float(static_cast<u32>(127 + e) << 23);
    } else {
        scale = 448.0f / amax;
        inv = mul_rn(amax, max_inv);
    }
}

// e4m3 of eight floats, packed in channel order.
PYEP_DEVICE int2 pack_e4m3(const float (&f)[8]) {
    u32 w[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
#ifdef PYEP_EMU
        w[h] = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) w[h] |= static_cast<u32>(to_e4m3(f[4 * h + k])) << (8 * k);
#else
        w[h] = static_cast<u32>(float2_to_e4m3x2(f[4 * h], f[4 * h + 1])) |
               static_cast<u32>(float2_to_e4m3x2(f[4 * h + 2], f[4 * h + 3])) << 16;
#endif
    }
    int2 out;
    out.x = static_cast<int>(w[0]);
    out.y = static_cast<int>(w[1]);
    return out;
}

}  // namespace pyep
