package pyep

import (
	"fmt"
	"time"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/jit"
)

// cudaBuffer finds buffer id and its cuda backend; lacks says what another backend lacks.
func cudaBuffer(id int64, lacks string) (*goep.Buffer, *cuda.Backend, error) {
	b, err := lookup(id)
	if err != nil {
		return nil, nil, err
	}
	be, ok := b.Backend().(*cuda.Backend)
	if !ok {
		return nil, nil, fmt.Errorf("the %s backend %s", b.Backend().Name(), lacks)
	}
	return b, be, nil
}

// BufferCommStream is the raw CUstream of the buffer's communication stream (cuda backend),
// for torch.cuda.ExternalStream.
func BufferCommStream(id int64) (stream uintptr, err error) {
	defer guard("BufferCommStream", &err)
	_, be, err := cudaBuffer(id, "has no CUDA stream: get_comm_stream() needs the cuda backend (an NCCL group on GPUs)")
	if err != nil {
		return 0, err
	}
	return be.CommStream().Raw(), nil
}

// BufferLastLaunchNs is CLOCK_MONOTONIC (Python's time.perf_counter clock), in nanoseconds,
// right after the latest kernel launch of the buffer's GPU (0 before the first).
func BufferLastLaunchNs(id int64) (ns int64, err error) {
	defer guard("BufferLastLaunchNs", &err)
	_, be, err := cudaBuffer(id, "launches no kernels")
	if err != nil {
		return 0, err
	}
	return be.LastLaunchNS(), nil
}

// SetOpTimeout sets the bound of the cuda kernels' waits on peers, in seconds, for calls made
// from now on (PYEP_TIMEOUT_S sets it at start-up); tests shorten it.
func SetOpTimeout(seconds float64) (err error) {
	defer guard("SetOpTimeout", &err)
	if !(seconds > 0) || seconds > 1e6 {
		return goep.Argf("seconds = %v: expected a positive number", seconds)
	}
	goep.SetOpTimeout(time.Duration(seconds * float64(time.Second)))
	return nil
}

// JITStats is how this process's kernel cache answered so far: "memory_hits disk_hits compiles".
func JITStats() string {
	s := jit.Default().Stats()
	return fmt.Sprintf("%d %d %d", s.MemoryHits, s.DiskHits, s.Compiles)
}
