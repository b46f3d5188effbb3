// Package cudall is low-latency mode's engine on the cuda backend (goep/cuda): one engine per
// buffer, made at sync over every rank's low-latency region (NewEngine, goep.Engines'
// LowLatency maker for cuda buffers; New for tests), which runs kernels/low_latency.cu on the
// caller's stream with the launch parameters of kernels/params.h (abi.go, cgo) and the device's
// compiled kernels from the backend. goep/lowlatency is the reference it matches bit for bit;
// goep/cuda/emu tests it under the fake driver.
package cudall
