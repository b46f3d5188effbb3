// nvshmem_nvrtc.cuh: NVSHMEM's device headers as NVRTC can take them. NVRTC has no C++ standard
// library, and NVSHMEM's headers use std::is_integral and friends, which CCCL's
// <cuda/std/type_traits> provides under cuda::std. Only builds linked with NVSHMEM include this
// (goep/jit's CompileLinked puts NVSHMEM's and CCCL's headers on the include path).
#pragma once

#include <cuda/std/type_traits>
namespace std {
using cuda::std::enable_if;
using cuda::std::is_floating_point;
using cuda::std::is_integral;
using cuda::std::is_same;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
using cuda::std::remove_reference;
}  // namespace std
#include <nvshmem.h>
#include <nvshmemx.h>
