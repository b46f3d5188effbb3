// registry.h: how variant translation units register their kernels with the emulator.
#pragma once
#include <cstddef>

namespace emu {
typedef void (*Thunk)(const void* params);
int add(const char* key, const char* kernel, Thunk fn, size_t params_bytes);
}  // namespace emu
