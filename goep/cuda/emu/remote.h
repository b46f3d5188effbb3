// remote.h: the emulator's remote_put_warp / remote_signal (kernels/remote.cuh), with the
// delivery of goep/lowlatency/remote.go: a put is only recorded, in its launch's list for the
// destination PE, and the next signal of the same launch to that PE lands every recorded put,
// newest first, before it stores the word. A kernel that signalled before its puts, rewrote a
// put's source before the signal, or forgot a signal would leave stale bytes or none, and the
// tests would see it (a launch that ends with puts still recorded fails: launch.h).
//
// A remote peer's region is named by its real mapping plus kSymmetricTag, an address no one can
// dereference: a kernel that wrote to a remote peer directly instead of through the pair faults
// here, as it would write into its own region on a GPU.
#pragma once

#include <vector>

#include "emu.h"

namespace pyep {

constexpr u64 kSymmetricTag = 1ull << 62;

PYEP_DEVICE u8* emu_unsymmetric(void* p) { return reinterpret_cast<u8*>(reinterpret_cast<u64>(p) - kSymmetricTag); }

PYEP_DEVICE void remote_put_warp(void* dst, const void* src, u64 n, int pe) {
    __syncwarp();
    if (lane_id() == 0) {
        ::emu::Launch* l = ::emu::self.launch;
        std::lock_guard<std::mutex> g(l->m);
        l->puts[pe].push_back(::emu::Put{emu_unsymmetric(dst), src, static_cast<size_t>(n)});
    }
    __syncwarp();
}

// Lands every put of this launch recorded for pe, newest first.
PYEP_DEVICE void emu_land_puts(int pe) {
    ::emu::Launch* l = ::emu::self.launch;
    std::lock_guard<std::mutex> g(l->m);
    std::vector<::emu::Put>& puts = l->puts[pe];
    for (size_t i = puts.size(); i-- > 0;) memcpy(puts[i].dst, puts[i].src, puts[i].n);
    puts.clear();
}

PYEP_DEVICE void remote_signal(u64* word, u64 v, int pe) {
    emu_land_puts(pe);
    __atomic_store_n(reinterpret_cast<u64*>(emu_unsymmetric(word)), v, __ATOMIC_RELEASE);
}

PYEP_DEVICE void remote_signal_add(u64* word, u64 v, int pe) {
    emu_land_puts(pe);
    __atomic_fetch_add(reinterpret_cast<u64*>(emu_unsymmetric(word)), v, __ATOMIC_RELEASE);
}

}  // namespace pyep
