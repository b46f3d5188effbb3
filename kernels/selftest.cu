// selftest.cu: exercises each helper family of utils.cuh once, so a broken helper (a PTX typo,
// an instruction the target arch lacks) fails to compile in CI, and a wrong one (rounding, lane
// order, ordering) fails in value on a GPU (goep/cuda's driver test checks the outputs).
//
// Configurations the CPU tests compile (see kernels/embed.go):
// pyep:defines PYEP_SELFTEST_SCALE=1
// pyep:defines PYEP_SELFTEST_SCALE=2 PYEP_TIMEOUT_NS=5000000
#include "utils.cuh"

using namespace pyep;

// A compile-time constant, as real kernels get their shapes: proves -D reaches the code.
#ifndef PYEP_SELFTEST_SCALE
#define PYEP_SELFTEST_SCALE 1
#endif

// One thread per element i < n:
//   sum[i]         = bf16((a[i] + b[i]) * PYEP_SELFTEST_SCALE), pairs packed through bf16x2
//   x_fp8[i]       = e4m3(x[i]) (saturating), x_back[i] = float(x_fp8[i])
//   y_back[i]      = float(fp16(y[i]))
//   warp_counts[w] = number of lanes of warp w (global warp index) with i < n, via warp_sum
// Thread 0 alone then waits for flags[0] (the host sets it before launching: must succeed) and
// for flags[1] (never set: must time out after timeout_ns and fill *err with rank, channel 7,
// what 42), and finally publishes flags[2] = 1 with a release store.
extern "C" __global__ void pyep_selftest(const u16* a, const u16* b, u16* sum, const float* x, u8* x_fp8,
                                         float* x_back, const float* y, float* y_back, i32* warp_counts,
                                         i32* flags, ErrorRecord* err, i32 rank, u64 timeout_ns, i32 n) {
    const i32 i = static_cast<i32>(blockIdx.x * blockDim.x + threadIdx.x);
    const float scale = static_cast<float>(PYEP_SELFTEST_SCALE);
    if (i < n) {
        const float s = (bf16_to_float(a[i]) + bf16_to_float(b[i])) * scale;
        if ((i & 1) == 0 && i + 1 < n) {
            const float s1 = (bf16_to_float(a[i + 1]) + bf16_to_float(b[i + 1])) * scale;
            *reinterpret_cast<u32*>(sum + i) = float2_to_bf16x2(s, s1);
        } else if ((i & 1) == 0) {
            sum[i] = float_to_bf16(s);
        }
        const u8 q = float_to_e4m3(x[i]);
        x_fp8[i] = q;
        x_back[i] = e4m3_to_float(q);
        y_back[i] = half_to_float(float_to_half(y[i]));
    }
    const i32 count = warp_sum(i < n ? 1 : 0);
    if (lane_id() == 0) warp_counts[i / 32] = count;

    if (i == 0) {
        bool ok = wait_until([&] { return ld_acquire_sys(flags) == 1; }, err, rank, 7, 41, timeout_ns);
        if (ok) wait_until([&] { return ld_volatile(flags + 1) == 1; }, err, rank, 7, 42, timeout_ns, 100);
        st_release_sys(flags + 2, 1);
    }
}
