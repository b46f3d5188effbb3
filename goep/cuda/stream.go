package cuda

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// CommStream is pyep's communication stream on this GPU: created by the Backend,
// non-blocking (it never waits behind the legacy default stream) and of the highest priority.
// Python wraps it as torch.cuda.ExternalStream (Buffer.get_comm_stream). Normal-mode calls with
// async_finish, previous_event or allocate_on_comm_stream run there; the usual call runs on the
// caller's stream (goep/cuda/normal/order.go).
func (b *Backend) CommStream() driver.Stream { return b.comm }

var _ goep.StreamBackend = (*Backend)(nil)

// CommStreamHandle implements goep.StreamBackend: the communication stream's raw CUstream.
func (b *Backend) CommStreamHandle() uintptr { return b.comm.Raw() }

// LaunchStamps implements goep.StreamBackend: CLOCK_MONOTONIC, in nanoseconds, when this backend's latest kernel
// launch entered the driver and right after it returned (0 before the first): where a call's host time ends, and how
// much of it the driver's launch took, for pyep.bench and bench/hostpath.py.
func (b *Backend) LaunchStamps() (start, end int64) { return b.launchStart.Load(), b.launchEnd.Load() }

// Launch queues kernel f on stream s with one parameter struct (a grid of grid blocks of block threads, no dynamic
// shared memory), stamping the driver's call (LaunchStamps). Every engine's launch goes through it.
func (b *Backend) Launch(f driver.Function, grid, block uint32, s driver.Stream, params unsafe.Pointer) error {
	start := driver.MonotonicNS()
	if err := f.Launch([3]uint32{grid, 1, 1}, [3]uint32{block, 1, 1}, 0, s, params); err != nil {
		return err
	}
	b.launchStart.Store(start)
	b.launchEnd.Store(driver.MonotonicNS())
	return nil
}

// WrapStream wraps a raw CUstream of this GPU that someone else owns, e.g. PyTorch's current
// stream as Python passes it (torch.cuda.current_stream().cuda_stream); 0 is the legacy
// default stream. Never Destroy it.
func (b *Backend) WrapStream(raw uintptr) driver.Stream { return driver.WrapStream(b.drv, raw) }

// StreamWait makes the work queued on waiter from now on wait for the work queued on on so far
// (an event recorded on on, waited for by waiter); the host does not block. E.g.
// StreamWait(comm, torch) before a dispatch reads tensors that PyTorch's stream produces, and
// StreamWait(torch, comm) after it.
func (b *Backend) StreamWait(waiter, on driver.Stream) error {
	if waiter == on {
		return nil
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	return b.StreamWaitEntered(waiter, on)
}

// StreamWaitEntered is StreamWait for a caller that has entered the backend's context (Enter):
// it costs no context switch of its own.
func (b *Backend) StreamWaitEntered(waiter, on driver.Stream) error {
	if waiter == on {
		return nil
	}
	// One event serves every call: cuStreamWaitEvent waits for the record current at the
	// time of the call, so re-recording afterwards is safe.
	b.waitMu.Lock()
	defer b.waitMu.Unlock()
	if err := b.waitEv.Record(on); err != nil {
		return err
	}
	return waiter.WaitEvent(b.waitEv)
}

var shared struct {
	sync.Mutex
	backends map[int]*Backend
}

// SharedBackend is this process's Backend of device ordinal over the real driver (Open), made
// on first use with the default options and kept for the life of the process, as PyTorch
// keeps its contexts and streams: every Buffer on the GPU shares its communication stream.
func SharedBackend(ordinal int) (*Backend, error) {
	shared.Lock()
	defer shared.Unlock()
	if b, ok := shared.backends[ordinal]; ok {
		return b, nil
	}
	drv, err := driver.Open()
	if err != nil {
		return nil, err
	}
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("pyep: cuda device %d: this process sees %d GPUs", ordinal, n)
	}
	// The backend's own waits (a peer releasing a buffer, the device draining) share the kernels'
	// bound, PYEP_TIMEOUT_S.
	b, err := NewBackend(drv, ordinal, BackendOptions{Timeout: goep.OpTimeout(), NVSHMEM: true})
	if err != nil {
		return nil, err
	}
	if shared.backends == nil {
		shared.backends = map[int]*Backend{}
	}
	shared.backends[ordinal] = b
	return b, nil
}
