package goep

import (
	"errors"

	"github.com/pyep/pyep/goep/env"
)

// The low-latency timeline, a diagnosis instrument (issue #18): with PYEP_LL_TIMELINE=1 set when
// the buffer is made, a device engine runs kernels built to stamp %globaltimer where each phase of
// each block ends (kernels/params.h names the stamps), and LowLatencyTimeline reads the last
// call's stamps.

// LLTimelines is a device engine that can record the timeline.
type LLTimelines interface {
	// Timeline returns the stamps of the last kernel of each kind (dispatch and combine, send and
	// receive), raw %globaltimer ns by block and stamp (0: not reached), and clears them; the
	// device is idle meanwhile. An engine made without PYEP_LL_TIMELINE=1 returns an error.
	Timeline() (RawLLTimeline, error)
}

// RawLLTimeline is an engine's stamps: Kernels[i] and Phases[i] name stamp i of every block's row.
type RawLLTimeline struct {
	Kernels, Phases []string
	Stamps          [][]uint64 // [block][stamp]
}

// LLTimeline is the stamps of LowLatencyTimeline, in ns after the earliest stamp read (-1: a
// phase the block did not reach, or a kernel that did not run since the last read).
type LLTimeline struct {
	Kernels, Phases []string
	Stamps          [][]int64 // [block][stamp]
}

// LowLatencyTimeline reads and clears the stamps of the low-latency kernels run since the last
// read (of each kind, the last one's): the timeline of a call, or of a hooked dispatch and
// combine, when read after each.
func (b *Buffer) LowLatencyTimeline() (*LLTimeline, error) {
	const op = "_low_latency_timeline"
	ll, err := b.lowLatency(op)
	if err != nil {
		return nil, err
	}
	defer ll.mu.Unlock()
	engine, ok := ll.device.(LLTimelines)
	if !ok {
		return nil, errors.New(op + ": the low-latency timeline is the cuda backend's (the stamps of its kernels); the " +
			b.backend.Name() + " backend runs no kernels")
	}
	raw, err := engine.Timeline()
	if err != nil {
		return nil, err
	}
	return relativeTimeline(raw), nil
}

// relativeTimeline makes raw's stamps ns after the earliest of them, -1 where absent.
func relativeTimeline(raw RawLLTimeline) *LLTimeline {
	var first uint64
	for _, row := range raw.Stamps {
		for _, v := range row {
			if v != 0 && (first == 0 || v < first) {
				first = v
			}
		}
	}
	t := &LLTimeline{Kernels: raw.Kernels, Phases: raw.Phases, Stamps: make([][]int64, len(raw.Stamps))}
	for b, row := range raw.Stamps {
		t.Stamps[b] = make([]int64, len(row))
		for i, v := range row {
			t.Stamps[b][i] = -1
			if v != 0 {
				t.Stamps[b][i] = int64(v - first)
			}
		}
	}
	return t
}

// ErrTimelineOff is the error of an engine made without PYEP_LL_TIMELINE=1.
var ErrTimelineOff = errors.New("_low_latency_timeline: the buffer's low-latency kernels record no timeline: set " +
	env.LLTimeline + "=1 before the Buffer is made")
