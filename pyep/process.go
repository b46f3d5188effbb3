package pyep

import (
	"fmt"

	"github.com/pyep/pyep/goep/api"
)

// BufferCommStream is the raw CUstream of the buffer's communication stream (cuda backend),
// for torch.cuda.ExternalStream.
func BufferCommStream(id int64) (stream uintptr, err error) {
	defer guard("BufferCommStream", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	return b.CommStream()
}

// BufferLastLaunchNs is CLOCK_MONOTONIC (Python's time.perf_counter clock), in nanoseconds,
// right after the latest kernel launch of the buffer's GPU (0 before the first).
func BufferLastLaunchNs(id int64) (ns int64, err error) {
	defer guard("BufferLastLaunchNs", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	_, ns, err = b.LaunchStamps()
	return ns, err
}

// BufferLastLaunchStartNs is CLOCK_MONOTONIC, in nanoseconds, when the latest kernel launch of
// the buffer's GPU entered the driver (0 before the first): with BufferLastLaunchNs, how long
// the driver's launch took.
func BufferLastLaunchStartNs(id int64) (ns int64, err error) {
	defer guard("BufferLastLaunchStartNs", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	ns, _, err = b.LaunchStamps()
	return ns, err
}

// SetOpTimeout sets the bound of every wait on a peer, in seconds, for calls made from now on
// (PYEP_TIMEOUT_S sets it at start-up); tests shorten it.
func SetOpTimeout(seconds float64) (err error) {
	defer guard("SetOpTimeout", &err)
	return api.SetOpTimeout(seconds)
}

// JITStats is how this process's kernel cache answered so far: "memory_hits disk_hits compiles".
func JITStats() string {
	s := api.KernelCacheStats()
	return fmt.Sprintf("%d %d %d", s.MemoryHits, s.DiskHits, s.Compiles)
}
