//go:build cgo

package cudanormal

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// Layout implements goep.NormalEngine: the counts on the GPU, queued without a wait (DeepEP's
// layout does not synchronise either). Its check of every expert index is recorded on the GPU
// and reported by the next dispatch's notify, on every rank.
func (e *engine) Layout(a *goep.LayoutOp) error {
	end, err := e.begin()
	defer end()
	if err != nil {
		return err
	}
	if e.layoutHost == nil {
		if e.layoutHost, e.layoutDev, err = e.b.HostAlloc(32); err != nil {
			return err
		}
	}
	T, K := int32(a.TopkIdx.Shape[0]), int32(a.TopkIdx.Shape[1])
	E, R := int32(a.NumExperts), int32(a.NumRanks)
	threads := int32(e.opts.LayoutThreads)
	f, err := e.b.Kernel(cuda.KernelKey{Kernel: cuda.KernelLayout, Threads: threads},
		func() map[string]string { return LayoutDefines(int(threads)) })
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	work, err := e.layoutWorkspace()
	if err != nil {
		return err
	}
	p := &e.params.layout
	*p = layoutParams{topk: u64(ptr(a.TopkIdx)), per_rank: u64(ptr(a.PerRank)), per_expert: u64(ptr(a.PerExpert)),
		in_rank: u64(ptr(a.InRank)), result: u64(uint64(e.layoutDev)), tag: u64(e.layoutTag + 1), work: u64(uint64(work)),
		timeout_ns: u64(uint64(goep.OpTimeout().Nanoseconds())), num_tokens: i32(T), num_topk: i32(K), num_experts: i32(E), num_ranks: i32(R)}
	if err := e.launch(f, layoutGrid(int(T), int(threads)), uint32(threads), unsafe.Pointer(p)); err != nil {
		return err
	}
	e.layoutTag++
	return e.orderAfter(a.Order)
}

// layoutGrid is the layout kernel's blocks: a token a thread, at least one block (block 0 zeroes
// the counts), at most maxLayoutBlocks (a block then takes several tokens a thread).
func layoutGrid(tokens, threads int) uint32 {
	return uint32(min(max((tokens+threads-1)/threads, 1), maxLayoutBlocks))
}

const maxLayoutBlocks = 1024

// layoutWorkspace is the layout kernel's workspace (layout.cu's gate and lock), made zero on
// the call's stream (after orderBefore) by the first layout.
func (e *engine) layoutWorkspace() (driver.DevicePtr, error) {
	if e.layoutWork != 0 {
		return e.layoutWork, nil
	}
	p, err := e.b.Driver().MemAlloc(layoutWorkBytes)
	if err != nil {
		return 0, fmt.Errorf("pyep: get_dispatch_layout's workspace (%d bytes): %w", layoutWorkBytes, err)
	}
	if err := e.b.Driver().MemsetD8Async(p, 0, layoutWorkBytes, e.stream); err != nil {
		return 0, errors.Join(err, e.b.Driver().MemFree(p))
	}
	e.layoutWork = p
	return p, nil
}

// Notify implements goep.NormalEngine. It does not join the caller's stream: the dispatch's data
// phase, which follows, does.
func (e *engine) Notify(peers []goep.Region, a *goep.NotifyOp) (int, error) {
	topo := e.env.Topo
	end, st, _, err := e.enterBuffer()
	defer end()
	if err != nil {
		return 0, err
	}
	scratchOff, err := e.prepareNotify(st, topo, peers, a)
	if err != nil {
		return 0, err
	}
	R, threads := int32(topo.NumNVLRanks), int32(e.opts.NotifyThreads)
	f, err := e.b.Kernel(cuda.KernelKey{Kernel: cuda.KernelNotify, Ranks: R, Threads: threads},
		func() map[string]string { return NotifyDefines(int(R), int(threads)) })
	if err != nil {
		return 0, err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return 0, err
	}
	seq := st.seq
	if err := e.launch(f, 1, uint32(threads), unsafe.Pointer(&e.params.queued.notify)); err != nil {
		return 0, err
	}
	st.seq += 2
	n, _, err := e.finishNotify(st, seq, topo, a, scratchOff)
	return n, err
}

// NotifyDispatch implements goep.SpeculativeEngine: notify and the dispatch into rows allocated
// before the counts are known (n.Capacity of them) in one launch (intranode.cu's
// pyep_notify_dispatch: notify in block 0, the data blocks after it), then the wait for notify's
// answer. The data blocks run only if every rank's rows fit (notify's verdict, the same on every
// rank); otherwise they return at once, ran is false, and the caller dispatches again into exact
// rows (that Dispatch follows the notify, as after Notify). n.Order orders the call: the stream
// order of a dispatch that does not run is the later Dispatch's.
func (e *engine) NotifyDispatch(peers []goep.Region, n *goep.NotifyOp, d *goep.DispatchOp) (numRecv int, ran bool, err error) {
	topo := e.env.Topo
	if n.Capacity <= 0 || int64(n.Capacity) != d.RecvX.Shape[0] {
		return 0, false, goep.Argf("dispatch: capacity = %d for %d allocated rows", n.Capacity, d.RecvX.Shape[0])
	}
	// The data blocks read the prefixes that block 0 writes.
	if ptr(d.RankPrefix) != ptr(n.RankPrefix) || ptr(d.ChannelPrefix) != ptr(n.ChannelPrefix) {
		return 0, false, errors.New("pyep: internal error: a queued dispatch reads other prefix matrices than its notify writes")
	}
	end, st, _, err := e.enterBuffer()
	defer end()
	if err != nil {
		return 0, false, err
	}
	scratchOff, err := e.prepareNotify(st, topo, peers, n)
	if err != nil {
		return 0, false, err
	}
	f, off, shape, err := e.prepareDispatch(st, topo, d, scratchOff, cuda.KernelNotifyDispatch)
	if err != nil {
		return 0, false, err
	}
	if err := e.orderBefore(n.Order); err != nil {
		return 0, false, err
	}
	// Both halves with the call's barrier numbers: block 0 passes them, the data blocks wait for
	// the second.
	seq := st.seq
	e.fillDispatch(&e.params.queued.dispatch, st, topo, peers, d, off)
	if err := e.launch(f, uint32(2*d.Config.NumChannels()+1), uint32(shape.Threads), unsafe.Pointer(&e.params.queued)); err != nil {
		return 0, false, err
	}
	st.seq += 2
	numRecv, ran, err = e.finishNotify(st, seq, topo, n, scratchOff)
	if err != nil || !ran {
		return numRecv, ran, err
	}
	st.notified = false // the dispatch consumed the notify
	return numRecv, ran, e.orderAfter(n.Order)
}

// prepareNotify checks a notify and fills its launch parameters (e.params.queued.notify).
func (e *engine) prepareNotify(st *bufferState, topo goep.Topology, peers []goep.Region,
	a *goep.NotifyOp) (scratchOff int64, err error) {
	b := e.b
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	E := a.NumExperts
	// goep checked the arguments' ranges; the capacity is what goep allocated.
	if a.Capacity < 0 || a.Capacity > goep.MaxRows {
		return 0, goep.Argf("dispatch: capacity = %d is out of range", a.Capacity)
	}
	blockBytes, scratch := notifyScratch(R, C, E)
	scratchOff = (e.env.NumNVLBytes - scratch) / 16 * 16
	_, counterBytes := counters(C, R)
	if counterBytes > scratchOff {
		return 0, tooSmall("dispatch", me, e.env.NumNVLBytes, counterBytes+scratch,
			fmt.Sprintf("the ring counters and the count exchange of %d ranks, %d channels and %d experts", R, C, E))
	}
	epr := E / R
	if st.resCap < epr {
		if st.resHost != nil {
			_ = b.Driver().MemFreeHost(st.resHost)
			st.resHost, st.resCap = nil, 0
		}
		n := max(epr, 256)
		if st.resHost, st.resDev, err = b.HostAlloc(notifyResultBytes + 4*n); err != nil {
			return 0, err
		}
		st.resCap = n
	}
	p := &e.params.queued.notify
	e.fillCtx(&p.ctx, st, topo, peers, a.Config)
	K := int32(0)
	if a.TopkIdx.Valid {
		K = int32(a.TopkIdx.Shape[1])
	}
	p.in_rank, p.per_rank, p.per_expert, p.topk = u64(ptr(a.InRank)), u64(ptr(a.PerRank)), u64(ptr(a.PerExpert)), u64(ptr(a.TopkIdx))
	if K == 0 {
		p.topk = 0
	}
	p.rank_prefix, p.channel_prefix, p.recv_channel_prefix = u64(ptr(a.RankPrefix)), u64(ptr(a.ChannelPrefix)), u64(ptr(a.RecvChannelPrefix))
	p.recv_per_expert, p.result = u64(ptr(a.RecvPerExpert)), u64(uint64(st.resDev))
	p.scratch_off, p.block_bytes = u64(scratchOff), u64(blockBytes)
	p.num_tokens, p.num_topk, p.num_experts = i32(a.NumTokens), i32(K), i32(E)
	p.alignment, p.num_worst, p.capacity = i32(a.ExpertAlignment), i32(a.NumWorstTokens), i32(a.Capacity)
	p.layout_rec, p.layout_tag = 0, 0
	if e.layoutTag > 0 {
		p.layout_rec, p.layout_tag = u64(uint64(e.layoutDev)), u64(e.layoutTag)
	}
	return scratchOff, nil
}

// finishNotify waits for the answer of the notify with barrier number seq.
func (e *engine) finishNotify(st *bufferState, seq uint64, topo goep.Topology, a *goep.NotifyOp, scratchOff int64) (int, bool, error) {
	res := (*notifyResult)(st.resHost)
	if err := e.waitHost(notifyTag(res), seq, st, "dispatch (notify)"); err != nil {
		if st.dead == nil {
			st.dead, st.reported = err, true
		}
		return 0, false, err
	}
	r := *res
	E, me := a.NumExperts, topo.NVLRank
	d0, d1, d2 := int64(r.d0), int64(r.d1), int64(r.d2)
	switch r.status {
	case 0:
	case 4:
		return 0, false, fmt.Errorf("dispatch: rank %d: no rank dispatches: rank %d has invalid arguments: %v", me, r.bad_rank,
			statusError(int32(r.peer_status), int(r.bad_rank), d0, d1, d2, E))
	case 5:
		return 0, false, goep.Argf("dispatch: num_worst_tokens = %d is too small: rank %d receives %d tokens", a.NumWorstTokens, r.bad_rank, d0)
	default:
		return 0, false, statusError(int32(r.status), me, d0, d1, d2, E)
	}
	epr := E / topo.NumNVLRanks
	st.perExpert = append(st.perExpert[:0], unsafe.Slice((*int32)(unsafe.Add(st.resHost, notifyResultBytes)), epr)...)
	st.notified, st.scratchOff = true, scratchOff
	return int(r.num_recv), r._go != 0, nil
}

// RecvPerExpert implements goep.PerExpertCounter: num_recv_tokens_per_expert of the buffer's
// last notify, the host's copy (no device synchronisation).
func (e *engine) RecvPerExpert() ([]int32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.st.perExpert == nil {
		return nil, errors.New("pyep: no dispatch on this buffer yet")
	}
	return append([]int32(nil), e.st.perExpert...), nil
}
