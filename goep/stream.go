package goep

import "fmt"

// StreamBackend is an optional Backend method set: a backend whose buffers' work runs on a
// communication stream (cuda), and when its latest kernel was launched.
type StreamBackend interface {
	// CommStreamHandle is the raw handle of the communication stream (a CUstream).
	CommStreamHandle() uintptr
	// LaunchStamps are CLOCK_MONOTONIC (ns) when the latest kernel launch entered the driver and
	// right after it returned (0 before any).
	LaunchStamps() (start, end int64)
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

// LaunchStamps are CLOCK_MONOTONIC (Python's time.perf_counter clock), in nanoseconds, when the
// latest kernel launch of the buffer's device entered the driver and right after it returned (0
// before the first).
func (b *Buffer) LaunchStamps() (start, end int64, err error) {
	s, ok := b.backend.(StreamBackend)
	if !ok {
		return 0, 0, fmt.Errorf("the %s backend launches no kernels", b.backend.Name())
	}
	start, end = s.LaunchStamps()
	return start, end, nil
}
