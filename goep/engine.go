package goep

import (
	"errors"
	"fmt"
	"unsafe"
)

// A Buffer runs each mode through an engine of its own, made on first use and closed by Destroy
// before the memory: the engine holds what one buffer's calls share (its barrier sequence, its
// error record, the mailbox of notify's answer). The backend provides the memory and, through
// NormalEngines (and siblings for low-latency and internode mode), makes the engines; the
// compiled kernels stay shared per device, with the backend.

// EngineEnv is what an engine is made for: the buffer's backend and ranks and the size of every
// NVLink-domain data region (each rank's region and its peers' are passed to every call).
type EngineEnv struct {
	Backend     Backend
	Topo        Topology
	NumNVLBytes int64
	// Remote are, by rank, the peers that a low-latency engine reaches through NVSHMEM's puts
	// and signals (its regions hold nil for them); nil: none.
	Remote []bool
}

// Engines are the makers of a buffer's engines, one per mode, for an engine that lives outside
// its backend's package (a per-mode package that imports the backend, as goep/cuda/normal and
// goep/cuda/lowlatency do): the composition root (goep/api) sets them in Params. A nil maker
// falls back to the backend's own (NormalEngines, LowLatencyEngines). An internode maker joins
// them here.
type Engines struct {
	Normal func(EngineEnv) (NormalEngine, error)
	// LowLatency makes the device engine of a low-latency buffer at Sync, for rank env.Topo.Rank,
	// with the arguments of LowLatencyEngines.NewLowLatencyEngine.
	LowLatency func(env EngineEnv, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (DeviceLowLatency, error)
}

// Engine is what every mode's engine has: Close releases what it holds, once the work it
// queued is done (bounded by the backend's timeout).
type Engine interface {
	Close() error
}

// NormalEngine runs one buffer's normal-mode operations. peers[i] is NVLink rank i's region as
// mapped here. The ops arrive checked; an engine orders its work after and before the caller's
// stream as their Order says.
type NormalEngine interface {
	Engine
	Layout(a *LayoutOp) error
	Notify(peers []Region, a *NotifyOp) (int, error)
	Dispatch(peers []Region, a *DispatchOp) error
	Combine(peers []Region, a *CombineOp) error
}

// NormalEngines is what a Backend implements whose buffers run normal mode.
type NormalEngines interface {
	NewNormalEngine(env EngineEnv) (NormalEngine, error)
}

// SpeculativeEngine is what a NormalEngine implements to queue a dispatch behind its notify,
// before the host learns the row count: into rows allocated for n.Capacity tokens, which the
// dispatch uses only if every rank's rows fit (the same verdict on every rank). It returns
// the rows this rank receives and whether the dispatch ran; if not, the caller dispatches
// again into exact rows, as after Notify. Without it, a queued dispatch waits for the counts.
type SpeculativeEngine interface {
	NotifyDispatch(peers []Region, n *NotifyOp, d *DispatchOp) (numRecv int, ran bool, err error)
}

// PerExpertCounter is what a NormalEngine implements that keeps the host's copy of the last
// notify's num_recv_tokens_per_expert (reading the tensor would wait for the device).
type PerExpertCounter interface {
	RecvPerExpert() ([]int32, error)
}

// engineOf returns the engine in slot, making it with make on first use; b.mu is held.
func engineOf[E Engine](b *Buffer, slot *E, make func(EngineEnv) (E, error)) (E, error) {
	var zero E
	if b.state == destroyed {
		return zero, errDestroyed
	}
	if any(*slot) != nil {
		return *slot, nil
	}
	e, err := make(EngineEnv{Backend: b.backend, Topo: b.topo, NumNVLBytes: b.params.NumNVLBytes})
	if err != nil {
		return zero, err
	}
	*slot = e
	b.engines = append(b.engines, e)
	return e, nil
}

// NormalEngine is the buffer's normal-mode engine, made on first use.
func (b *Buffer) NormalEngine() (NormalEngine, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.normalEngineLocked()
}

func (b *Buffer) normalEngineLocked() (NormalEngine, error) {
	maker := b.params.Engines.Normal
	if be, ok := b.backend.(NormalEngines); ok && maker == nil {
		maker = be.NewNormalEngine
	}
	if maker == nil {
		return nil, fmt.Errorf("normal mode is not available on the %s backend", b.backend.Name())
	}
	return engineOf(b, &b.normal, maker)
}

// closeEngines closes every engine, newest first; b.mu is held.
func (b *Buffer) closeEngines() error {
	var errs []error
	for i := len(b.engines) - 1; i >= 0; i-- {
		errs = append(errs, b.engines[i].Close())
	}
	b.engines, b.normal = nil, nil
	return errors.Join(errs...)
}

// normalOrNil is the normal engine if one was made.
func (b *Buffer) normalOrNil() NormalEngine {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.normal
}
