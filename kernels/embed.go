// Package kernels holds pyep's CUDA C++ sources. They are compiled at run time by NVRTC
// (goep/jit) rather than shipped prebuilt: the gopy .so carries no CUDA toolkit, the GPU's
// architecture is known only on the user's machine, and shape constants such as the hidden size
// become compile-time constants (-DPYEP_HIDDEN_BYTES=...) that the compiler can unroll around.
//
// Conventions for files here:
//   - kernels include only our own headers (utils.cuh, protocol.cuh, params.h and other *.cuh at
//     this root): NVRTC is given no toolkit headers, so <cuda_bf16.h> and friends are not available; under
//     PYEP_EMU (the emulator, goep/cuda/emu) emu.h stands in for utils.cuh;
//   - entry points are declared in namespace pyep (the emulator finds them there);
//   - entry points are extern "C" so that the host looks them up by their plain names;
//   - a .cu file may declare representative compile-time constants in comment lines of the form
//     "// pyep:defines NAME=VALUE NAME2=VALUE2"; every such line is one configuration that the
//     CPU tests compile, so a kernel that only breaks for some constants is caught in CI.
package kernels

import "embed"

// FS holds every kernel source (*.cu) and header (*.cuh; params.h, plain C that Go includes
// too) at its root.
//
//go:embed *.cu *.cuh *.h
var FS embed.FS
