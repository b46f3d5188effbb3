// Package driver is pyep's binding of the CUDA driver API, in go-nvml's layers: goep/dl opens
// libcuda.so.1 on first use (Open) and resolves its entry points, so that building pyep needs no
// CUDA toolkit and a process that only uses the cpu backend never loads a driver; this package
// binds them as a typed API (Device, Context, Stream, Event, Module, Function, DevicePtr,
// IpcMemHandle; errors wrap a Result); and all of it goes through the Driver interface, which
// driver/fake implements over host memory so that code above this layer is tested without a
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
package driver
