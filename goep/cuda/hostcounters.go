package cuda

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"
)

// CounterUnset is what a HostCounters counter holds until the device writes it.
const CounterUnset int32 = -1

// HostCounters are int32 counters in pinned host memory mapped into the device
// (cuMemHostAlloc with DEVICEMAP): kernels write them through Device() (plain stores, or
// atomics at system scope) and the CPU waits for them, as DeepEP's normal mode waits for the
// number of tokens each rank will receive before it allocates the receive tensors.
type HostCounters struct {
	b    *Backend
	host unsafe.Pointer
	dev  DevicePtr
	n    int
}

// NewHostCounters allocates n counters, all CounterUnset.
func (b *Backend) NewHostCounters(n int) (*HostCounters, error) {
	if n <= 0 {
		return nil, fmt.Errorf("pyep: cuda: %d host counters: expected at least one", n)
	}
	if err := b.usable(); err != nil {
		return nil, err
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return nil, err
	}
	p, err := b.drv.MemHostAlloc(4*n, HostAllocPortable|HostAllocDeviceMap)
	if err != nil {
		return nil, err
	}
	d, err := b.drv.MemHostGetDevicePointer(p)
	if err != nil {
		_ = b.drv.MemFreeHost(p)
		return nil, err
	}
	h := &HostCounters{b: b, host: p, dev: d, n: n}
	h.Reset()
	return h, nil
}

// Len is the number of counters.
func (h *HostCounters) Len() int { return h.n }

// Device is the counters' address for kernels: counter i is the int32 at Device() + 4*i.
func (h *HostCounters) Device() DevicePtr { return h.dev }

// Host is the host view of the counters. The device writes them behind the compiler's back:
// read them with Load (or sync/atomic), never as plain memory in a loop.
func (h *HostCounters) Host() []int32 { return unsafe.Slice((*int32)(h.host), h.n) }

// Load reads counter i.
func (h *HostCounters) Load(i int) int32 { return atomic.LoadInt32(&h.Host()[i]) }

// Store writes counter i.
func (h *HostCounters) Store(i int, v int32) { atomic.StoreInt32(&h.Host()[i], v) }

// Reset sets every counter to CounterUnset; do it before launching the kernel that sets them.
func (h *HostCounters) Reset() {
	for i := range h.n {
		h.Store(i, CounterUnset)
	}
}

// ErrCounterTimeout is what Wait's error wraps when counters never arrived.
var ErrCounterTimeout = errors.New("timed out")

// Wait blocks until every counter is set (>= 0), timeout passes, or a stream in watch fails,
// and returns the counters' values. On timeout the error lists what never arrived: what(i)
// describes counter i (e.g. "the token count from rank 3"); nil describes it as "counter i".
// Watching the streams the kernels run on turns a failed kernel (an illegal address, ...)
// into an error at once instead of a timeout.
func (h *HostCounters) Wait(timeout time.Duration, what func(i int) string, watch ...Stream) ([]int32, error) {
	deadline := time.Now().Add(timeout)
	vals := make([]int32, h.n)
	spins := 0
	for pause := time.Duration(0); ; {
		missing := h.snapshot(vals)
		if missing == 0 {
			return vals, nil
		}
		if spins++; spins%64 == 0 && len(watch) > 0 {
			if err := h.checkStreams(watch); err != nil {
				return vals, fmt.Errorf("pyep: waiting for %s: %w", h.describe(vals, what), err)
			}
		}
		if !time.Now().Before(deadline) {
			return vals, fmt.Errorf("pyep: waited %v for %s from the GPU, which never arrived (a peer rank did not take part, or a kernel is stuck): %w",
				timeout, h.describe(vals, what), ErrCounterTimeout)
		}
		if spins > 1000 {
			pause = min(max(2*pause, time.Microsecond), 100*time.Microsecond)
			time.Sleep(pause)
		}
	}
}

func (h *HostCounters) snapshot(vals []int32) (missing int) {
	for i := range vals {
		if vals[i] = h.Load(i); vals[i] < 0 {
			missing++
		}
	}
	return missing
}

func (h *HostCounters) describe(vals []int32, what func(int) string) string {
	var parts []string
	for i, v := range vals {
		if v >= 0 {
			continue
		}
		if len(parts) == 8 {
			parts = append(parts, "...")
			break
		}
		if what != nil {
			parts = append(parts, what(i))
		} else {
			parts = append(parts, fmt.Sprintf("counter %d", i))
		}
	}
	return strings.Join(parts, ", ")
}

func (h *HostCounters) checkStreams(watch []Stream) error {
	exit, err := h.b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	for _, s := range watch {
		if _, err := s.Query(); err != nil {
			return err
		}
	}
	return nil
}

// Close frees the counters; idempotent.
func (h *HostCounters) Close() error {
	if h.host == nil {
		return nil
	}
	exit, err := h.b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	err = h.b.drv.MemFreeHost(h.host)
	h.host = nil
	return err
}
