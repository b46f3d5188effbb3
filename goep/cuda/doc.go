// Package cuda is pyep's layer over the CUDA driver API: libcuda.so.1 is opened with dlopen on
// first use (Open), so that building pyep needs no CUDA toolkit and a process that only uses
// the cpu backend never loads a driver.
//
// The API is typed (Device, Context, Stream, Event, Module, Function, DevicePtr, IpcMemHandle;
// errors wrap a Result), and all of it goes through the Driver interface, which
// goep/cuda/fake implements over host memory so that code above this layer is tested without a
// GPU.
//
// Contexts: pyep works in each device's primary context, the one the CUDA runtime and thus
// PyTorch use, so that PyTorch's tensors and streams are valid in our calls. The current
// context is per OS thread, so every entry from Go locks its goroutine to the thread and makes
// the context current first:
//
//	runtime.LockOSThread()
//	defer runtime.UnlockOSThread()
//	if err := ctx.MakeCurrent(); err != nil { ... }
//
// Backend (backend.go) is goep's cuda backend on this layer: NVLink-domain buffers in device
// memory shared through CUDA IPC, or with use_fabric through cuMem fabric handles or POSIX
// file descriptors (memshare.go, fdshare_linux.go), with a header per buffer for the release
// handshake of Destroy, CheckPeers' NVLink check over NVML (NVLinkProbe), pyep's
// communication stream and StreamWait, and HostCounters (mapped host memory the CPU waits on
// with a timeout).
// SharedBackend is the one per GPU and process that the Python binding uses.
//
// normal.go makes Backend a goep.NormalEngine: normal mode's kernels (kernels/layout.cu,
// kernels/intranode.cu) compiled by goep/jit for the GPU and the call's shape, launched on the
// communication stream. goep/cuda/emu runs the same kernels on the host under the fake driver,
// so the engine and the kernels are tested without a GPU.
package cuda
