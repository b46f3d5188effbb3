package goep

import "fmt"

// StreamBackend is an optional Backend method set: a backend whose buffers' work runs on a
// communication stream (cuda), and when its latest kernel was launched.
type StreamBackend interface {
	// CommStreamHandle is the raw handle of the communication stream (a CUstream).
	CommStreamHandle() uintptr
	// LastLaunchNS is CLOCK_MONOTONIC (ns) right after the latest kernel launch (0 before any).
	LastLaunchNS() int64
}

// CommStream is the raw handle of the communication stream of the buffer's backend, for
// torch.cuda.ExternalStream.
func (b *Buffer) CommStream() (uintptr, error) {
	s, ok := b.backend.(StreamBackend)
	if !ok {
		return 0, fmt.Errorf("the %s backend has no CUDA stream: get_comm_stream() needs the cuda backend (an NCCL group on GPUs)", b.backend.Name())
	}
	return s.CommStreamHandle(), nil
}

// LastLaunchNS is CLOCK_MONOTONIC (Python's time.perf_counter clock), in nanoseconds, right
// after the latest kernel launch of the buffer's device (0 before the first).
func (b *Buffer) LastLaunchNS() (int64, error) {
	s, ok := b.backend.(StreamBackend)
	if !ok {
		return 0, fmt.Errorf("the %s backend launches no kernels", b.backend.Name())
	}
	return s.LastLaunchNS(), nil
}
