// Package cuda is goep's cuda backend, over the driver binding (goep/cuda/driver): NVLink-domain
// buffers in device memory shared through CUDA IPC, or with use_fabric through cuMem fabric
// handles or POSIX file descriptors (memshare.go, fdshare_linux.go), with a header per buffer
// for the release handshake of Destroy, CheckPeers' NVLink check over NVML (NVLinkProbe), pyep's
// communication stream and StreamWait (stream.go). SharedBackend is the one per GPU and process
// that goep/api hands out.
//
// The backend is memory and the device; it runs no mode (of the modes it knows only their
// kernels' files and symbols, and their block sizes). Each mode's engine is a package of its
// own that imports this one (goep/cuda/normal, goep/cuda/lowlatency), made for a buffer through
// goep.Params.Engines, which the composition root (goep/api) sets. What the engines use
// of the backend is exported for them: Enter (the context current on the OS thread), Driver and
// Device, the communication stream (CommStream, StreamWaitEntered), Launch (every kernel launch, stamped), HostAlloc
// (host-mapped records), SyncDevice, PtrOf (peers' regions as device addresses), RanksOnDevice,
// and the device's compiled kernels (kernels.go: Kernel by KernelKey, compiled by goep/jit for
// the GPU and the call's shape on a miss, shared by every buffer's engines; NormalOptions).
// goep/cuda/emu runs the same kernels on the host under the fake driver, so the engines and the
// kernels are tested without a GPU.
package cuda
