// launch.h: the emulator's launcher, built into every kernel library with the kernels it runs
// (emu.go's wrapper includes it after the kernel source): a launch runs grid x block OS
// threads, one per CUDA thread, and returns when all are done. Every library has its own copy
// of everything here (hidden symbols), so libraries never share a thread's state.
#pragma once
#include <pthread.h>

#include <cstring>
#include <memory>
#include <vector>

#include "emu.h"

thread_local emu::Thread emu::self;

namespace emu {

// An entry point: call(fn, params) runs the kernel on the calling thread.
struct Kernel {
    const char* name;
    void (*fn)();  // the kernel, its type erased; null where why says
    void (*call)(void (*fn)(), const void* params);
    size_t params_bytes;
    const char* why;
};

template <typename P>
void call(void (*fn)(), const void* params) {
    reinterpret_cast<void (*)(P)>(fn)(*static_cast<const P*>(params));
}

// A kernel of one parameter struct passed by value: every pyep kernel's shape.
template <typename P>
Kernel kernel(const char* name, void (*fn)(P)) {
    return Kernel{name, reinterpret_cast<void (*)()>(fn), &call<P>, sizeof(P), nullptr};
}
template <typename... A>
Kernel kernel(const char* name, void (*)(A...)) {
    return Kernel{name, nullptr, nullptr, 0, "it does not take one parameter struct, which is all the emulator passes"};
}
// What the wrapper names where the source's defines leave an entry point out.
struct Absent {};
inline Kernel kernel(const char* name, Absent) {
    return Kernel{name, nullptr, nullptr, 0, "the defines it was built with leave it out"};
}

struct Start {
    Thread t;
    const Kernel* k;
    const void* params;
};

static void* run(void* arg) {
    Start* s = static_cast<Start*>(arg);
    self = s->t;
    s->k->call(s->k->fn, s->params);
    return nullptr;
}

}  // namespace emu

// Runs k over grid x block threads; params is copied first. Returns 0, -1 if a thread could not
// be started, or -2 if the kernel left puts without a signal after them (remote.h).
extern "C" __attribute__((visibility("default"))) int emu_launch(const emu::Kernel* k, unsigned grid, unsigned block,
                                                                 const void* params) {
    std::vector<char> copy(static_cast<const char*>(params), static_cast<const char*>(params) + k->params_bytes);
    emu::Launch launch;
    std::vector<std::unique_ptr<emu::Block>> blocks;
    for (unsigned b = 0; b < grid; b++) {
        blocks.emplace_back(new emu::Block());
        blocks.back()->threads = static_cast<int>(block);
        blocks.back()->warps = new emu::Warp[(block + 31) / 32];
    }
    std::vector<emu::Start> starts(static_cast<size_t>(grid) * block);
    std::vector<pthread_t> threads(starts.size());
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    size_t started = 0;
    int rc = 0;
    for (unsigned b = 0; b < grid && rc == 0; b++) {
        for (unsigned t = 0; t < block; t++) {
            emu::Start& s = starts[static_cast<size_t>(b) * block + t];
            s.t.thread = dim3{t, 0, 0};
            s.t.block = dim3{b, 0, 0};
            s.t.block_dim = dim3{block, 1, 1};
            s.t.grid_dim = dim3{grid, 1, 1};
            s.t.b = blocks[b].get();
            s.t.launch = &launch;
            s.k = k;
            s.params = copy.data();
            if (pthread_create(&threads[started], &attr, emu::run, &s) != 0) {
                rc = -1;
                break;
            }
            started++;
        }
    }
    pthread_attr_destroy(&attr);
    // A launch that could not start every thread would deadlock at the first barrier; the
    // caller sees -1 (and the started threads are left to their fate: tests fail anyway).
    if (rc != 0) return rc;
    for (size_t i = 0; i < started; i++) pthread_join(threads[i], nullptr);
    for (auto& kv : launch.puts)
        if (!kv.second.empty()) return -2;
    return 0;
}
