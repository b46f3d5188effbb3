package pyep

import (
	"fmt"
	"strconv"
	"strings"
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

// streamOrder orders the buffer's communication stream and stream, a raw CUstream of its GPU
// (PyTorch's current stream): with commWaits, the work queued on the communication stream from
// now on waits for what stream holds so far; otherwise stream waits for the communication
// stream. The host does not block.
func streamOrder(be *cuda.Backend, stream uintptr, commWaits bool) error {
	other := be.WrapStream(stream)
	if commWaits {
		return be.StreamWait(be.CommStream(), other)
	}
	return be.StreamWait(other, be.CommStream())
}

// The stream order of a normal-mode export, the flags of its order argument: torch's Stream
// objects and events, or a call of its own, would cost microseconds more.
const (
	orderBefore = 1 // the communication stream waits for stream before the call's work (no previous_event)
	orderAfter  = 2 // stream waits for the communication stream after it (not async_finish)
)

// ordered runs op between the stream orders that order asks for, on the cuda backend; the cpu
// backend's calls have finished when they return, so it has none.
func ordered(b *goep.Buffer, stream uintptr, order int, op func() error) error {
	be, ok := b.Backend().(*cuda.Backend)
	if !ok || order == 0 {
		return op()
	}
	if order&orderBefore != 0 {
		if err := streamOrder(be, stream, true); err != nil {
			return err
		}
	}
	if err := op(); err != nil {
		return err
	}
	if order&orderAfter != 0 {
		return streamOrder(be, stream, false)
	}
	return nil
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

// BufferRecvPerExpert is num_recv_tokens_per_expert of the buffer's last dispatch notify on
// the cuda backend, space-separated: the host's copy, so reading it waits for no stream.
func BufferRecvPerExpert(id int64) (counts string, err error) {
	defer guard("BufferRecvPerExpert", &err)
	b, be, err := cudaBuffer(id, "keeps no host copy of the counts")
	if err != nil {
		return "", err
	}
	peers, err := b.Peers()
	if err != nil {
		return "", err
	}
	vals, err := be.RecvPerExpert(peers[b.Topology().NVLRank])
	if err != nil {
		return "", err
	}
	var sb strings.Builder
	for i, v := range vals {
		if i > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString(strconv.Itoa(int(v)))
	}
	return sb.String(), nil
}

// SetOpTimeout sets the bound of the cuda kernels' waits on peers, in seconds, for calls made
// from now on (PYEP_TIMEOUT_S sets it at start-up); tests shorten it.
func SetOpTimeout(seconds float64) (err error) {
	defer guard("SetOpTimeout", &err)
	if !(seconds > 0) || seconds > 1e6 {
		return goep.Argf("seconds = %v: expected a positive number", seconds)
	}
	cuda.SetOpTimeout(time.Duration(seconds * float64(time.Second)))
	return nil
}

// JITStats is how this process's kernel cache answered so far: "memory_hits disk_hits compiles".
func JITStats() string {
	s := jit.Default().Stats()
	return fmt.Sprintf("%d %d %d", s.MemoryHits, s.DiskHits, s.Compiles)
}
