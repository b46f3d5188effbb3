// utils.cuh: the small device toolkit every pyep kernel builds on.
//
// NVRTC is handed no toolkit headers (the .so must work with a bare NVRTC from a pip wheel), so
// the types and conversions that cuda_bf16.h / cuda_fp8.h / <cstdint> would give are spelled out
// here. Most helpers are one inline-PTX instruction: the PTX ISA fixes their rounding and memory
// ordering exactly, where a C++ spelling would leave it to the compiler.
#pragma once

#define PYEP_DEVICE __device__ __forceinline__

// Shared memory of a kernel, declared inside it: PYEP_SHARED(i32, name, n) is an array of n.
// (A macro so that the host emulation of the kernels can give each block its own.)
#define PYEP_SHARED(T, name, n) __shared__ T name[n]

namespace pyep {

// ---------------------------------------------------------------------------------------------
// Fixed-width integers. Short names in our namespace rather than <cstdint>'s: they cannot clash
// with a definition NVRTC might grow, and the host side (Go) spells its layouts the same way.
typedef signed char i8;
typedef unsigned char u8;
typedef short i16;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
static_assert(sizeof(i8) == 1 && sizeof(i16) == 2 && sizeof(i32) == 4 && sizeof(i64) == 8,
              "pyep kernels assume LP64 integer sizes; the host layouts do too");

// ---------------------------------------------------------------------------------------------
// bf16 / fp16. Values are carried as raw u16 bit patterns: tensors arrive from PyTorch as plain
// bytes, and without cuda_bf16.h there is no __nv_bfloat16 type to wrap them in anyway.

// Exact and arch-independent: a bf16 is the upper half of the float with the same value.
PYEP_DEVICE float bf16_to_float(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

// Round to nearest even, as PyTorch does on the host, so GPU and CPU results match bit for bit.
PYEP_DEVICE u16 float_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Packs two floats in one instruction; lo lands in the low half (the lower address in memory).
PYEP_DEVICE u32 float2_to_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

PYEP_DEVICE float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

PYEP_DEVICE u16 float_to_half(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// ---------------------------------------------------------------------------------------------
// FP8 e4m3 (sm_89+). The hardware converts pairs; single-value helpers waste half a conversion,
// which is fine outside the hot loops.

// Largest finite e4m3 value: per-block scales are chosen so that amax maps to it.
constexpr float kE4M3Max = 448.0f;

// satfinite clamps out-of-range values to +-448 instead of producing NaN, which is what a
// scaled quantizer wants when rounding pushes amax/scale a hair above the limit.
PYEP_DEVICE u16 float2_to_e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

PYEP_DEVICE u8 float_to_e4m3(float f) { return static_cast<u8>(float2_to_e4m3x2(f, 0.0f) & 0xff); }

// Every e4m3 value is exactly representable in fp16, so going through f16x2 loses nothing.
PYEP_DEVICE float2 e4m3x2_to_float2(u16 v) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    return make_float2(half_to_float(static_cast<u16>(h2 & 0xffff)), half_to_float(static_cast<u16>(h2 >> 16)));
}

PYEP_DEVICE float e4m3_to_float(u8 v) { return e4m3x2_to_float2(v).x; }

// ---------------------------------------------------------------------------------------------
// Loads and stores with explicit ordering and scope. Ranks signal each other through flags in
// peer GPUs' memory (NVLink) and in host-mapped memory, so the scope must be .sys for anything a
// peer GPU or the CPU reads, .gpu for flags only this GPU's blocks share; .acquire/.release give
// the ordering without a full fence. .volatile is for polling where no ordering is needed.
// Pointers are generic addresses of global (device, peer or host-mapped) memory, which CUDA maps
// identically into the .global window.

#define PYEP_DEFINE_LD(name, sem, T, ty, c)                                                        \
    PYEP_DEVICE T name(const T* p) {                                                               \
        T v;                                                                                       \
        asm volatile("ld." sem ".global." ty " %0, [%1];" : "=" c(v) : "l"(p) : "memory");         \
        return v;                                                                                  \
    }
#define PYEP_DEFINE_ST(name, sem, T, ty, c)                                                        \
    PYEP_DEVICE void name(T* p, T v) {                                                             \
        asm volatile("st." sem ".global." ty " [%0], %1;" ::"l"(p), c(v) : "memory");              \
    }
#define PYEP_DEFINE_LD_ST(T, ty, c)                                                                \
    PYEP_DEFINE_LD(ld_acquire_sys, "acquire.sys", T, ty, c)                                        \
    PYEP_DEFINE_LD(ld_acquire_gpu, "acquire.gpu", T, ty, c)                                        \
    PYEP_DEFINE_LD(ld_relaxed_sys, "relaxed.sys", T, ty, c)                                        \
    PYEP_DEFINE_LD(ld_volatile, "volatile", T, ty, c)                                              \
    PYEP_DEFINE_ST(st_release_sys, "release.sys", T, ty, c)                                        \
    PYEP_DEFINE_ST(st_release_gpu, "release.gpu", T, ty, c)                                        \
    PYEP_DEFINE_ST(st_relaxed_sys, "relaxed.sys", T, ty, c)                                        \
    PYEP_DEFINE_ST(st_volatile, "volatile", T, ty, c)

PYEP_DEFINE_LD_ST(i32, "b32", "r")
PYEP_DEFINE_LD_ST(u32, "b32", "r")
PYEP_DEFINE_LD_ST(i64, "b64", "l")
PYEP_DEFINE_LD_ST(u64, "b64", "l")

#undef PYEP_DEFINE_LD_ST
#undef PYEP_DEFINE_ST
#undef PYEP_DEFINE_LD

// Signals a counter to another GPU or the host: release so that the data written before it is
// visible first; red (no return value) so the issuing thread does not wait for the round trip.
PYEP_DEVICE void red_add_release_sys(i32* p, i32 v) {
    asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Adds v to *p (this GPU's memory or a peer's) with no ordering of its own: a fence before it makes
// it a release (the classic fence, then relaxed RMW); red, so the thread does not wait for the reply.
PYEP_DEVICE void red_add_relaxed_sys(u64* p, u64 v) {
    asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Adds v to *p and returns the old value, with acquire and release semantics among this GPU's blocks.
PYEP_DEVICE i32 atomic_add_acq_rel_gpu(i32* p, i32 v) {
    i32 old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

PYEP_DEVICE u32 atomic_cas_relaxed_sys(u32* p, u32 expected, u32 desired) {
    u32 old;
    asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(old)
                 : "l"(p), "r"(expected), "r"(desired)
                 : "memory");
    return old;
}

// ---------------------------------------------------------------------------------------------
// Time, sleeping, lanes.

// Nanoseconds from a clock shared by all SMs (unlike clock64, which is per SM and scales with
// the clock rate), so a timeout means the same on every block and GPU.
PYEP_DEVICE u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Backs off a polling warp so the SM's other warps (the ones doing the copying) get issue slots.
PYEP_DEVICE void nanosleep(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

PYEP_DEVICE u32 lane_id() {
    u32 l;
    asm("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}

// ---------------------------------------------------------------------------------------------
// Bounded waits. A rank that crashed or never launched would otherwise leave its peers spinning
// forever, which hangs the GPU and takes the host process down with a watchdog at best. With a
// bound, the waiter gives up, records who was waiting for what, and the kernel can exit; the host
// then turns the record into an error naming the rank and channel that stalled.

// Default wait bound; kernels built with -DPYEP_TIMEOUT_NS=... use another.
#ifndef PYEP_TIMEOUT_NS
#define PYEP_TIMEOUT_NS 100000000000ull  // 100 s: far beyond any healthy wait, short of a hang
#endif

// Why the first failure was recorded. Codes above 0xffff are free for kernels.
enum ErrorCode : u32 {
    kErrorNone = 0,
    kErrorTimeout = 1,
};

// Lives in host-mapped memory so the CPU can read it while the kernel is still running (or
// after it hangs). Layout is shared with the Go side: keep it at 32 bytes, fields in this order.
struct ErrorRecord {
    u32 claimed;    // set by the one waiter that gets to fill the record
    u32 code;       // ErrorCode, published last (release) once the fields below are written
    i32 rank;       // the rank that was waiting
    i32 channel;    // its channel (or block) index
    i32 what;       // kernel-defined id of the awaited condition, e.g. "tail of peer 3"
    u32 block;      // blockIdx.x of the waiter
    u64 waited_ns;  // how long it waited before giving up
};
static_assert(sizeof(ErrorRecord) == 32, "ErrorRecord layout is shared with the host");

// Only the first failure is kept: later timeouts are usually knock-on effects of the first.
PYEP_DEVICE void record_error(ErrorRecord* rec, ErrorCode code, i32 rank, i32 channel, i32 what, u64 waited_ns) {
    if (rec == nullptr || atomic_cas_relaxed_sys(&rec->claimed, 0u, 1u) != 0u) return;
    st_relaxed_sys(&rec->rank, rank);
    st_relaxed_sys(&rec->channel, channel);
    st_relaxed_sys(&rec->what, what);
    st_relaxed_sys(&rec->block, static_cast<u32>(blockIdx.x));
    st_relaxed_sys(&rec->waited_ns, waited_ns);
    st_release_sys(&rec->code, static_cast<u32>(code));
}

// Spins until ready() holds or timeout_ns pass; on timeout records (rank, channel, what) and
// returns false so the caller can bail out. The clock is read only after the first miss, as
// most waits are satisfied at once. sleep_ns > 0 naps between polls (see nanosleep).
template <typename Ready>
PYEP_DEVICE bool wait_until(Ready ready, ErrorRecord* rec, i32 rank, i32 channel, i32 what,
                            u64 timeout_ns = PYEP_TIMEOUT_NS, u32 sleep_ns = 0) {
    if (ready()) return true;
    const u64 start = globaltimer();
    for (;;) {
        if (sleep_ns != 0) nanosleep(sleep_ns);
        if (ready()) return true;
        const u64 waited = globaltimer() - start;
        if (waited > timeout_ns) {
            record_error(rec, kErrorTimeout, rank, channel, what, waited);
            return false;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bulk data movement. Rows move as vectors of VEC bytes (16 where the row size and every base
// address allow it); Vec<N>::T is the register type of one vector.

template <int N> struct Vec;
template <> struct Vec<16> { typedef int4 T; };
template <> struct Vec<8> { typedef int2 T; };
template <> struct Vec<4> { typedef int T; };
template <> struct Vec<2> { typedef short T; };
template <> struct Vec<1> { typedef char T; };

// Read-only inputs (tensors no kernel writes while we run): the non-coherent path, and no L1
// allocation since every byte is read once.
PYEP_DEVICE int4 ld_nc(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
PYEP_DEVICE int2 ld_nc(const int2* p) {
    int2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
PYEP_DEVICE int ld_nc(const int* p) {
    int v;
    asm volatile("ld.global.nc.L1::no_allocate.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
PYEP_DEVICE short ld_nc(const short* p) {
    short v;
    asm volatile("ld.global.nc.L1::no_allocate.s16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
PYEP_DEVICE char ld_nc(const char* p) {
    short v;
    asm volatile("ld.global.nc.L1::no_allocate.s8 %0, [%1];" : "=h"(v) : "l"(p));
    return static_cast<char>(v);
}
PYEP_DEVICE float ld_nc(const float* p) { return __int_as_float(ld_nc(reinterpret_cast<const int*>(p))); }
PYEP_DEVICE i64 ld_nc(const i64* p) {
    i64 v;
    asm volatile("ld.global.nc.L1::no_allocate.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// Memory that other GPUs write while we run (the rings in our own buffer): relaxed loads at
// gpu scope are served by L2, which NVLink writes land in, never by a stale L1 line. The
// ordering comes from the acquire of the ring's tail that precedes them.
PYEP_DEVICE int4 ld_ring(const int4* p) {
    int4 v;
    asm volatile("ld.relaxed.gpu.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
PYEP_DEVICE int2 ld_ring(const int2* p) {
    int2 v;
    asm volatile("ld.relaxed.gpu.global.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
    return v;
}
PYEP_DEVICE int ld_ring(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
PYEP_DEVICE short ld_ring(const short* p) {
    short v;
    asm volatile("ld.relaxed.gpu.global.s16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
PYEP_DEVICE char ld_ring(const char* p) {
    short v;
    asm volatile("ld.relaxed.gpu.global.s8 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return static_cast<char>(v);
}
PYEP_DEVICE float ld_ring(const float* p) { return __int_as_float(ld_ring(reinterpret_cast<const int*>(p))); }
PYEP_DEVICE i64 ld_ring(const i64* p) {
    i64 v;
    asm volatile("ld.relaxed.gpu.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Streaming stores (outputs, peers' rings): no L1 allocation.
PYEP_DEVICE void st_na(int4* p, int4 v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
PYEP_DEVICE void st_na(int2* p, int2 v) {
    asm volatile("st.global.L1::no_allocate.v2.s32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
PYEP_DEVICE void st_na(int* p, int v) {
    asm volatile("st.global.L1::no_allocate.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
PYEP_DEVICE void st_na(short* p, short v) {
    asm volatile("st.global.L1::no_allocate.s16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}
PYEP_DEVICE void st_na(char* p, char v) {
    asm volatile("st.global.L1::no_allocate.s8 [%0], %1;" ::"l"(p), "h"(static_cast<short>(v)) : "memory");
}

// A zero vector of any of the Vec types.
template <typename V> PYEP_DEVICE V vec_zero() {
    V v;
    char* b = reinterpret_cast<char*>(&v);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(V)); i++) b[i] = 0;
    return v;
}

// ---------------------------------------------------------------------------------------------
// Block- and warp-level synchronisation beyond __syncthreads.

// Named barrier id (1..15; 0 is __syncthreads') over the first n threads that reach it; n is a
// multiple of 32. Lets the warp groups of one block synchronise independently.
PYEP_DEVICE void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }

// Shared-memory flags between warps of one block (generic addresses of shared memory).
#define PYEP_DEFINE_CTA(T, ty, c)                                                                  \
    PYEP_DEVICE T ld_acquire_cta(const T* p) {                                                     \
        T v;                                                                                       \
        asm volatile("ld.acquire.cta." ty " %0, [%1];" : "=" c(v) : "l"(p) : "memory");            \
        return v;                                                                                  \
    }                                                                                              \
    PYEP_DEVICE void st_release_cta(T* p, T v) {                                                   \
        asm volatile("st.release.cta." ty " [%0], %1;" ::"l"(p), c(v) : "memory");                 \
    }
PYEP_DEFINE_CTA(i32, "b32", "r")
PYEP_DEFINE_CTA(u64, "b64", "l")
#undef PYEP_DEFINE_CTA
PYEP_DEVICE void red_add_release_cta(i32* p, i32 v) {
    asm volatile("red.release.cta.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Orders everything this thread observed or wrote before it (cumulatively: also what other
// threads released to it) before its later writes, for every observer in the system.
PYEP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The same among this GPU's blocks.
PYEP_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// The pause of a busy-wait that has no timeout of its own: nothing on the GPU, where the waiter
// owns its SM (the emulator yields the CPU instead).
PYEP_DEVICE void spin_pause() {}

// Compare-and-swap at system scope on device memory (own or a peer's over NVLink).
PYEP_DEVICE u64 atomic_cas_sys(u64* p, u64 expected, u64 desired) {
    u64 old;
    asm volatile("atom.relaxed.sys.global.cas.b64 %0, [%1], %2, %3;"
                 : "=l"(old) : "l"(p), "l"(expected), "l"(desired) : "memory");
    return old;
}

// Lanes below this one, as a mask (for ranking a lane among the set bits of a ballot).
PYEP_DEVICE u32 lanemask_lt() {
    u32 m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// ---------------------------------------------------------------------------------------------
// Warp reductions: butterfly shuffles, so every lane ends up with the result and no lane has to
// broadcast it afterwards.

template <typename T>
PYEP_DEVICE T warp_sum(T v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
    return v;
}

template <typename T>
PYEP_DEVICE T warp_max(T v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
        const T o = __shfl_xor_sync(0xffffffffu, v, mask);
        v = o > v ? o : v;
    }
    return v;
}

template <typename T>
PYEP_DEVICE T warp_min(T v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
        const T o = __shfl_xor_sync(0xffffffffu, v, mask);
        v = o < v ? o : v;
    }
    return v;
}

}  // namespace pyep
