// Package cpu is the cpu backend: the NVLink-domain buffer is a shared-memory segment that each
// rank's process maps, and normal-mode operations move data between processes through it.
package cpu

import (
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/shm"
)

// headerBytes is a page in front of the control region holding this backend's own bookkeeping,
// so that the data region stays page aligned.
const headerBytes = 4096

// header is the start of every segment. Whoever maps it last removes its name, so that a rank
// killed after sync leaves nothing in /dev/shm.
type header struct {
	mapped   atomic.Int32 // processes that have mapped the segment, its creator included
	expected int32        // 1 + the number of peers that will map it
}

// Backend is the cpu backend; its zero value is ready. It has no goep.FabricAllocator:
// use_fabric changes nothing on host memory, which is always shared through /dev/shm.
type Backend struct{}

var _ goep.Backend = Backend{}

// Name implements goep.Backend.
func (Backend) Name() string { return "cpu" }

// DeviceID implements goep.Backend: host memory has no device.
func (Backend) DeviceID() int { return -1 }

type region struct {
	seg *shm.Segment
}

func (r *region) hdr() *header            { return (*header)(r.seg.Ptr()) }
func (r *region) Control() unsafe.Pointer { return unsafe.Add(r.seg.Ptr(), headerBytes) }
func (r *region) Data() unsafe.Pointer    { return unsafe.Add(r.seg.Ptr(), headerBytes+goep.ControlBytes) }
func (r *region) Token() []byte           { return []byte(r.seg.Name) }
func segmentBytes(size int64) int64       { return headerBytes + goep.ControlBytes + size }
func (r *region) Close() error            { return r.seg.Close() }

type local struct{ region }

// Close removes the name too: a segment whose peers never mapped it must not outlive its owner.
func (l *local) Close() error {
	return errors.Join(l.seg.Unlink(), l.seg.Close())
}

// Allocate implements goep.Backend.
func (Backend) Allocate(size int64, numPeers int) (goep.LocalRegion, error) {
	shm.Sweep()
	seg, err := shm.Create(segmentBytes(size))
	if err != nil {
		return nil, err
	}
	l := &local{region{seg}}
	l.hdr().expected = int32(1 + numPeers)
	l.mapped()
	return l, nil
}

// mapped counts one more mapping and removes the name once everyone has one.
func (r *region) mapped() {
	if r.hdr().mapped.Add(1) == r.hdr().expected {
		_ = r.seg.Unlink()
	}
}

// Open implements goep.Backend.
func (Backend) Open(token []byte, size int64) (goep.Region, error) {
	seg, err := shm.Open(string(token), segmentBytes(size))
	if err != nil {
		return nil, err
	}
	r := &region{seg}
	if n := r.hdr().mapped.Load(); n >= r.hdr().expected {
		_ = seg.Close()
		return nil, fmt.Errorf("segment %s is already mapped by all %d ranks it was made for", seg.Name, n)
	}
	r.mapped()
	return r, nil
}

// rdma is anonymous memory outside the Go heap, since Python tensors view it.
type rdma struct{ mem []byte }

func (r *rdma) Data() unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(r.mem)) }

func (r *rdma) Close() error {
	if r.mem == nil {
		return nil
	}
	err := syscall.Munmap(r.mem)
	r.mem = nil
	return err
}

// AllocateRDMA implements goep.Backend. Without NVSHMEM the RDMA buffer is this process's own
// memory; cross-domain transfers over it come with the internode work.
func (Backend) AllocateRDMA(size int64) (goep.RDMARegion, error) {
	if size <= 0 || size != int64(int(size)) {
		return nil, fmt.Errorf("num_rdma_bytes = %d: out of range for this process", size)
	}
	mem, err := syscall.Mmap(-1, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, fmt.Errorf("allocate %d RDMA bytes: %w", size, err)
	}
	return &rdma{mem}, nil
}
