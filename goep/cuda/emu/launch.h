// launch.h: the emulator's launcher, built into every kernel library with the kernels it runs
// (emu.go's wrapper includes it after the kernel source): a launch runs grid x block OS
// threads, one per CUDA thread, and returns when all are done. Every library has its own copy
// of everything here (hidden symbols), so libraries never share a thread's state.
//
// PYEP_EMU_RESIDENT_BLOCKS=n (n > 0) lets at most n blocks of a launch run at once, started in
// block order as earlier ones end: a GPU, or an MPS client's share of one, with room for fewer
// blocks than the grid. Unset or 0: every block at once.
#pragma once
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
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

// The blocks of a launch that are running, against PYEP_EMU_RESIDENT_BLOCKS.
struct Residency {
    std::mutex m;
    std::condition_variable cv;
    int running = 0;
};

struct Start {
    Thread t;
    const Kernel* k;
    const void* params;
    Residency* res;
    std::atomic<int>* left;  // threads of the block still running
};

static void* run(void* arg) {
    Start* s = static_cast<Start*>(arg);
    self = s->t;
    s->k->call(s->k->fn, s->params);
    if (s->left->fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> l(s->res->m);
        s->res->running--;
        s->res->cv.notify_all();
    }
    return nullptr;
}

static int resident_blocks() {
    const char* v = std::getenv("PYEP_EMU_RESIDENT_BLOCKS");
    return v != nullptr ? std::atoi(v) : 0;
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
    std::unique_ptr<std::atomic<int>[]> left(new std::atomic<int>[grid]);
    emu::Residency res;
    const int resident = emu::resident_blocks();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    size_t started = 0;
    int rc = 0;
    for (unsigned b = 0; b < grid && rc == 0; b++) {
        left[b].store(static_cast<int>(block));
        {
            std::unique_lock<std::mutex> l(res.m);
            if (resident > 0) res.cv.wait(l, [&] { return res.running < resident; });
            res.running++;
        }
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
            s.res = &res;
            s.left = &left[b];
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
