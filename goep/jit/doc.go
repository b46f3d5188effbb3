// Package jit compiles pyep's CUDA kernels at run time, with NVRTC for the GPU or with the host
// C++ compiler for the emulator (goep/cuda/emu), and caches the results.
//
// Kernels are specialised on shapes (hidden size, number of ranks, ...) that are known only when
// a Buffer is created, and on the GPU at hand, so they cannot be prebuilt into the gopy .so
// without a combinatorial explosion; NVRTC is what PyTorch's CUDA wheels already ship, so it is
// there wherever pyep's cuda backend can run.
//
// NVRTC lives here rather than in goep/cuda because compiling needs no GPU and no driver: the
// CPU tests compile every kernel on machines without either, and goep/cuda stays a thin
// driver layer. Both libraries are opened with dlopen, so building pyep needs no CUDA at all.
//
// A kernel that calls into a static device library (NVSHMEM's libnvshmem_device.a) takes a
// link step: CompileLinked runs NVRTC to LTO-IR (-rdc=true -dlto), then nvJitLink, also opened
// with dlopen and found beside NVRTC or in the wheels, links it with the library into a cubin.
// Its headers come from disk (the library's include directory, the CUDA headers beside NVRTC).
//
// Cache: Compile (a cubin), CompileLinked (a linked cubin) and CompileHost (a shared object,
// loaded) look in memory, then in DefaultDir ($PYEP_JIT_CACHE_DIR or ~/.cache/pyep), then
// compile. All key by one recipe: the source and the headers it includes, the full command line
// (arch or host flags, -D defines, flags; a link's options too) and the compiler's identity (the
// NVRTC version, and nvJitLink's for a link; the host compiler's path and --version); a link
// adds what it reads from disk: its include directories' files by name, size and modification
// time, and its libraries by content. So an edited kernel is a new key for the GPU and the
// emulator alike, and any shape compiles on demand for either. A compile reports one line on
// stderr unless PYEP_JIT_QUIET=1.
package jit
