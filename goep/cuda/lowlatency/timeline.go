//go:build cgo

package cudall

/*
#include "../../../kernels/params.h"

// Stamp i's kernel (2 i) or phase (2 i + 1), in the enum's order.
#define PYEP_LL_STAMP_NAME(id, kernel, phase) kernel, phase,
static const char* pyep_ll_stamp_name(int i) {
	static const char* names[] = {PYEP_LL_STAMP_LIST(PYEP_LL_STAMP_NAME)};
	return names[i];
}
*/
import "C"

import (
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// The timeline (PYEP_LL_TIMELINE=1 when the engine is made): the kernels, built with the define
// (their own kernel cache entries), stamp where each phase of each block ends into a host-mapped
// u64 [blocks][stampsPerBlock] (kernels/params.h's pyep_ll_params.timeline), which Timeline reads.

const (
	timelineDefine = "PYEP_LL_TIMELINE"
	stampsPerBlock = int(C.PYEP_LL_STAMPS)
)

// stamps is the engine's stamp buffer, for up to blocks blocks.
type stamps struct {
	host   unsafe.Pointer
	dev    driver.DevicePtr
	blocks int
}

func newStamps(b *cuda.Backend, blocks int) (*stamps, error) {
	host, dev, err := b.HostAlloc(8 * stampsPerBlock * blocks)
	if err != nil {
		return nil, err
	}
	return &stamps{host: host, dev: dev, blocks: blocks}, nil
}

// free releases s (nil: nothing); the context is current.
func (s *stamps) free(b *cuda.Backend) error {
	if s == nil {
		return nil
	}
	return b.Driver().MemFreeHost(s.host)
}

// stampNames are the kernel and the phase of every stamp.
func stampNames() (kernels, phases []string) {
	for i := range stampsPerBlock {
		kernels = append(kernels, C.GoString(C.pyep_ll_stamp_name(C.int(2*i))))
		phases = append(phases, C.GoString(C.pyep_ll_stamp_name(C.int(2*i+1))))
	}
	return kernels, phases
}

var _ goep.LLTimelines = (*Engine)(nil)

// Timeline implements goep.LLTimelines: once the device is idle, every block's stamps (of the
// grid's blocks), which it clears.
func (e *Engine) Timeline() (goep.RawLLTimeline, error) {
	if e.stamps == nil {
		return goep.RawLLTimeline{}, goep.ErrTimelineOff
	}
	kernels, phases := stampNames()
	t := goep.RawLLTimeline{Kernels: kernels, Phases: phases}
	err := e.idle(func() error {
		all := unsafe.Slice((*uint64)(e.stamps.host), stampsPerBlock*e.stamps.blocks)
		for b := range min(e.grid(e.b.NormalOptions()), e.stamps.blocks) {
			t.Stamps = append(t.Stamps, append([]uint64(nil), all[b*stampsPerBlock:(b+1)*stampsPerBlock]...))
		}
		clear(all)
		return nil
	})
	return t, err
}
