// emu.h: just enough of CUDA, on the host, to run pyep's kernels (kernels/*.cu compiled as C++
// with -DPYEP_EMU) for tests without a GPU. Every CUDA thread is an OS thread; a warp's
// collectives and a block's barriers are condition-variable barriers; shared memory is a
// per-block arena. Memory ordering is the host's (x86: stronger than the GPU's), so this finds
// logic errors (indices, protocol, deadlocks, rounding), not missing fences.
//
// It replaces utils.cuh: the same names in namespace pyep, with host implementations.
#pragma once

#include <sched.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#define PYEP_DEVICE static inline
#define __global__
#define __launch_bounds__(...)
#define PYEP_SHARED(T, name, n) T* name = ::emu::shared<T>(#name, (n))

struct int4 {
    int x, y, z, w;
};
struct int2 {
    int x, y;
};
struct float2 {
    float x, y;
};
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct dim3 {
    unsigned x, y, z;
};

namespace emu {

// A reusable barrier for n threads; wait_or also returns whether any thread passed a nonzero v
// (the value of the generation just completed stays readable until every thread arrives again).
struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    int arrived = 0;
    unsigned gen = 0;
    int any = 0, result = 0;
    void wait(int n) { wait_or(n, 0); }
    int wait_or(int n, int v) {
        std::unique_lock<std::mutex> l(m);
        const unsigned g = gen;
        any |= v != 0 ? 1 : 0;
        if (++arrived >= n) {
            arrived = 0;
            result = any;
            any = 0;
            gen++;
            cv.notify_all();
            return result;
        }
        cv.wait(l, [&] { return gen != g; });
        return result;
    }
};

struct Warp {
    Barrier bar;
    uint64_t slot[32];
};

struct Block {
    std::mutex m;
    std::map<std::string, void*> shared;
    Barrier named[16];
    Warp* warps;
    int threads;
    ~Block() {
        for (auto& kv : shared) free(kv.second);
        delete[] warps;
    }
};

// A put that remote.h recorded and the next signal to its PE lands.
struct Put {
    void* dst;
    const void* src;
    size_t n;
};

// What the threads of one launch share: the puts recorded so far, by destination PE.
struct Launch {
    std::mutex m;
    std::map<int, std::vector<Put>> puts;
};

struct Thread {
    dim3 thread, block, block_dim, grid_dim;
    Block* b;
    Launch* launch;
};

extern thread_local Thread self;

template <typename T>
T* shared(const char* name, size_t n) {
    Block* b = self.b;
    std::lock_guard<std::mutex> l(b->m);
    void*& p = b->shared[name];
    if (p == nullptr) {
        p = malloc(n * sizeof(T) + 16);
        memset(p, 0xab, n * sizeof(T) + 16);  // shared memory starts as garbage
    }
    return static_cast<T*>(p);
}

inline Warp& warp() { return self.b->warps[self.thread.x / 32]; }
inline int lane() { return static_cast<int>(self.thread.x % 32); }

template <typename T>
uint64_t bits(T v) {
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
T unbits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

// Every lane publishes a value; returns once all 32 have. Call collect() to read, then done().
inline void publish(uint64_t v) {
    Warp& w = warp();
    w.slot[lane()] = v;
    w.bar.wait(32);
}
inline void done() { warp().bar.wait(32); }

}  // namespace emu

#define threadIdx (::emu::self.thread)
#define blockIdx (::emu::self.block)
#define blockDim (::emu::self.block_dim)
#define gridDim (::emu::self.grid_dim)

static inline void __syncthreads() { ::emu::self.b->named[0].wait(::emu::self.b->threads); }
static inline int __syncthreads_or(int p) { return ::emu::self.b->named[0].wait_or(::emu::self.b->threads, p); }
static inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::warp().bar.wait(32); }

template <typename T>
static inline T __shfl_sync(unsigned, T v, int src) {
    ::emu::publish(::emu::bits(v));
    T r = ::emu::unbits<T>(::emu::warp().slot[src & 31]);
    ::emu::done();
    return r;
}
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int mask) {
    ::emu::publish(::emu::bits(v));
    T r = ::emu::unbits<T>(::emu::warp().slot[(::emu::lane() ^ mask) & 31]);
    ::emu::done();
    return r;
}
template <typename T>
static inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
    ::emu::publish(::emu::bits(v));
    const int l = ::emu::lane();
    T r = l >= static_cast<int>(delta) ? ::emu::unbits<T>(::emu::warp().slot[l - delta]) : v;
    ::emu::done();
    return r;
}
static inline unsigned __ballot_sync(unsigned, bool p) {
    ::emu::publish(p ? 1 : 0);
    unsigned m = 0;
    for (int i = 0; i < 32; i++) m |= static_cast<unsigned>(::emu::warp().slot[i] & 1) << i;
    ::emu::done();
    return m;
}
static inline bool __all_sync(unsigned mask, bool p) { return __ballot_sync(mask, p) == 0xffffffffu; }
static inline bool __any_sync(unsigned mask, bool p) { return __ballot_sync(mask, p) != 0; }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
static inline float __int_as_float(int v) { return ::emu::unbits<float>(static_cast<uint32_t>(v)); }
static inline float __uint_as_float(unsigned v) { return ::emu::unbits<float>(v); }
static inline unsigned __float_as_uint(float f) { return ::emu::unbits<unsigned>(::emu::bits(f)); }

template <typename T>
static inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
static inline T max(T a, T b) { return a < b ? b : a; }

static inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
static inline long long atomicMin(long long* p, long long v) {
    long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
static inline int atomicMin(int* p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicAnd(unsigned* p, unsigned v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

namespace pyep {

typedef signed char i8;
typedef unsigned char u8;
typedef short i16;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

PYEP_DEVICE float bf16_to_float(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }
PYEP_DEVICE u16 float_to_bf16(float f) {
    u32 b = ::emu::unbits<u32>(::emu::bits(f));
    if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return static_cast<u16>(b >> 16);
}
PYEP_DEVICE float half_to_float(u16 h) {
    const u32 sign = static_cast<u32>(h & 0x8000u) << 16;
    const u32 exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        float f = static_cast<float>(man) * (1.0f / 16777216.0f);
        return __uint_as_float(::emu::unbits<u32>(::emu::bits(f)) | sign);
    }
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | man << 13);
    return __uint_as_float(sign | (exp + 112) << 23 | man << 13);
}
PYEP_DEVICE u16 float_to_half(float f) {
    const u32 b = ::emu::unbits<u32>(::emu::bits(f));
    const u16 sign = static_cast<u16>((b >> 16) & 0x8000u);
    const i32 exp = static_cast<i32>((b >> 23) & 0xff);
    const u32 man = b & 0x7fffffu;
    if (exp == 0xff) return static_cast<u16>(sign | (man != 0 ? 0x7e00 : 0x7c00));
    const i32 e = exp - 127 + 15;
    if (e >= 0x1f) return static_cast<u16>(sign | 0x7c00);
    if (e <= 0) {
        const u32 shift = static_cast<u32>(14 - e);
        if (shift > 24) return sign;
        const u32 m = man | 0x800000u;
        u32 r = m >> shift;
        const u32 rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return static_cast<u16>(sign | r);
    }
    u32 r = static_cast<u32>(e) << 10 | man >> 13;
    const u32 rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
    return static_cast<u16>(sign | r);
}

#define PYEP_EMU_LD_ST(T)                                                                              \
    PYEP_DEVICE T ld_acquire_sys(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }          \
    PYEP_DEVICE T ld_acquire_gpu(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }          \
    PYEP_DEVICE T ld_relaxed_sys(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }          \
    PYEP_DEVICE T ld_volatile(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }             \
    PYEP_DEVICE void st_release_sys(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }           \
    PYEP_DEVICE void st_release_gpu(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }           \
    PYEP_DEVICE void st_relaxed_sys(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }           \
    PYEP_DEVICE void st_volatile(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
PYEP_EMU_LD_ST(i32)
PYEP_EMU_LD_ST(u32)
PYEP_EMU_LD_ST(i64)
PYEP_EMU_LD_ST(u64)
#undef PYEP_EMU_LD_ST

PYEP_DEVICE u64 globaltimer() {
    sched_yield();  // every poll of a wait passes here: let the awaited threads run
    return static_cast<u64>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
}
PYEP_DEVICE void nanosleep(u32) { sched_yield(); }
PYEP_DEVICE u32 lane_id() { return static_cast<u32>(::emu::lane()); }
PYEP_DEVICE u32 lanemask_lt() { return (1u << lane_id()) - 1u; }

template <int N> struct Vec;
template <> struct Vec<16> { typedef int4 T; };
template <> struct Vec<8> { typedef int2 T; };
template <> struct Vec<4> { typedef int T; };
template <> struct Vec<2> { typedef short T; };
template <> struct Vec<1> { typedef char T; };

// Loads and stores of data: plain accesses (ordered by the acquires and releases around them).
template <typename T>
PYEP_DEVICE T ld_nc(const T* p) {
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}
template <typename T>
PYEP_DEVICE T ld_ring(const T* p) {
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}
template <typename T>
PYEP_DEVICE void st_na(T* p, T v) {
    memcpy(p, &v, sizeof(T));
}
template <typename V>
PYEP_DEVICE V vec_zero() {
    V v;
    memset(&v, 0, sizeof(V));
    return v;
}

PYEP_DEVICE void bar_sync(int id, int n) { ::emu::self.b->named[id].wait(n); }
PYEP_DEVICE i32 ld_acquire_cta(const i32* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
PYEP_DEVICE void st_release_cta(i32* p, i32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
PYEP_DEVICE u64 ld_acquire_cta(const u64* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
PYEP_DEVICE void st_release_cta(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
PYEP_DEVICE void red_add_release_cta(i32* p, i32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
PYEP_DEVICE void red_add_relaxed_sys(u64* p, u64 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
PYEP_DEVICE void fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
PYEP_DEVICE void fence_acq_rel_gpu() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
PYEP_DEVICE i32 atomic_add_acq_rel_gpu(i32* p, i32 v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
PYEP_DEVICE void spin_pause() { sched_yield(); }
PYEP_DEVICE u64 atomic_cas_sys(u64* p, u64 expected, u64 desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

template <typename T>
PYEP_DEVICE T warp_sum(T v) {
    for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
    return v;
}
template <typename T>
PYEP_DEVICE T warp_max(T v) {
    for (int mask = 16; mask > 0; mask >>= 1) {
        const T o = __shfl_xor_sync(0xffffffffu, v, mask);
        v = o > v ? o : v;
    }
    return v;
}
template <typename T>
PYEP_DEVICE T warp_min(T v) {
    for (int mask = 16; mask > 0; mask >>= 1) {
        const T o = __shfl_xor_sync(0xffffffffu, v, mask);
        v = o < v ? o : v;
    }
    return v;
}

}  // namespace pyep
