// runtime.cc: the emulator's kernel registry and launcher (see emu.h).
#include <pthread.h>

#include <memory>
#include <string>
#include <vector>

#include "emu.h"
#include "registry.h"

thread_local emu::Thread emu::self;

namespace emu {

struct Entry {
    std::string key, kernel;
    Thunk fn;
    size_t params_bytes;
};

static std::vector<Entry>& registry() {
    static std::vector<Entry> r;
    return r;
}

int add(const char* key, const char* kernel, Thunk fn, size_t params_bytes) {
    registry().push_back(Entry{key, kernel, fn, params_bytes});
    return 0;
}

struct Start {
    Thread t;
    Thunk fn;
    const void* params;
};

static void* run(void* arg) {
    Start* s = static_cast<Start*>(arg);
    self = s->t;
    s->fn(s->params);
    return nullptr;
}

}  // namespace emu

extern "C" int emu_find(const char* key, const char* kernel) {
    auto& r = emu::registry();
    for (size_t i = 0; i < r.size(); i++)
        if (r[i].key == key && r[i].kernel == kernel) return static_cast<int>(i);
    return -1;
}

extern "C" int emu_count() { return static_cast<int>(emu::registry().size()); }
extern "C" const char* emu_key(int id) { return emu::registry()[id].key.c_str(); }
extern "C" const char* emu_kernel(int id) { return emu::registry()[id].kernel.c_str(); }

// Runs kernel id over grid x block threads; params is copied first. Returns 0, or -1 if a
// thread could not be started (then none ran).
extern "C" int emu_launch(int id, unsigned grid, unsigned block, const void* params) {
    const emu::Entry& e = emu::registry()[id];
    std::vector<char> copy(static_cast<const char*>(params), static_cast<const char*>(params) + e.params_bytes);
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
            s.fn = e.fn;
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
    return 0;
}
