// Package cudanormal is normal mode's engine on the cuda backend (goep/cuda): one engine per
// buffer (NewEngine, goep.Engines' Normal maker for cuda buffers), which runs kernels/layout.cu
// and kernels/intranode.cu on the caller's stream or the backend's communication stream
// (order.go), with the launch parameters of
// kernels/params.h (abi.go, cgo), the device's compiled kernels from the backend, and the
// layout of the rings in every rank's region (rings.go). goep/normal is the reference it
// matches bit for bit; goep/cuda/emu tests it under the fake driver.
package cudanormal
