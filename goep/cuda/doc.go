// Package cuda is goep's cuda backend, over the driver binding (goep/cuda/driver): NVLink-domain
// buffers in device memory shared through CUDA IPC, or with use_fabric through cuMem fabric
// handles or POSIX file descriptors (memshare.go, fdshare_linux.go), with a header per buffer
// for the release handshake of Destroy, CheckPeers' NVLink check over NVML (NVLinkProbe), pyep's
// communication stream and StreamWait (stream.go). SharedBackend is the one per GPU and process
// that goep/api hands out.
//
// The backend is memory and the device; the normal-mode engine of each buffer (normal_engine.go,
// made by NewNormalEngine for goep.Buffer) runs normal mode's kernels (kernels/layout.cu,
// kernels/intranode.cu, with kernels/params.h shared with normal_abi.go), compiled by goep/jit
// for the GPU and the call's shape and kept per device (normal_kernels.go), launched on the
// communication stream. goep/cuda/emu runs the same kernels on the host under the fake driver,
// so the engine and the kernels are tested without a GPU.
package cuda
