package goep

import (
	"errors"
	"math"
	"sync"
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
)

// A dispatch is DispatchQueued (notify, and the data phase queued behind it), or DispatchNotify
// and then DispatchRecv (the data phase into rows allocated once the count is known); a cached
// dispatch is DispatchCached.

// DispatchArgs are a dispatch's (not cached): the caller's tensors and settings, and the outputs
// whose size does not depend on the rows received (the handle's matrices, send_head and the
// per-expert counts; data addresses).
type DispatchArgs struct {
	Config                                       Config
	ExpertAlignment, NumWorstTokens              int
	X, XScales, TopkIdx, TopkWeights             Desc
	PerRank, PerExpert, InRank                   Desc
	RankPrefix, ChannelPrefix, RecvChannelPrefix uintptr
	RecvPerExpert, SendHead                      uintptr
	// Counts is host memory for num_recv_tokens_per_expert as int32s (0: not wanted): the Python
	// layer's list, which reading the tensor would make wait for the GPU on cuda.
	Counts uintptr
	Order  StreamOrder
}

// RecvTensors are a dispatch's outputs of one row per received token, Rows of them (data
// addresses; 0 for those the call has none of).
type RecvTensors struct {
	Rows                                     int
	X, XScales, SrcIdx, TopkIdx, TopkWeights uintptr
}

// CachedDispatchArgs are a cached dispatch's: x (and its scales), the handle's tensors (data
// addresses) and sizes, and the outputs.
type CachedDispatchArgs struct {
	Config     Config
	X, XScales Desc
	// The handle's is_token_in_rank rows, channel_prefix_matrix columns and recv_src_idx rows.
	NumTokens, NumChannels, NumRecv   int
	RankPrefix, ChannelPrefix, InRank uintptr
	RecvX, RecvXScales                uintptr
	Order                             StreamOrder
}

// errMultiDomain is what a dispatch across NVLink domains raises (and the Python layer said).
func (b *Buffer) errMultiDomain() error {
	if b.topo.NumRDMARanks > 1 {
		return NotAvailablef("dispatch across NVLink domains (%d ranks) is not available yet%s", b.topo.NumRanks, b.topo.nodesHint())
	}
	return nil
}

// rows checks a dispatch's x: rows of any dtype, which move as bytes (as DeepEP's do), or x[0] of
// 1-byte elements (FP8) with its scales x[1], float32 or int32 (packed UE8M0), row- or
// column-major (scaleStrides; the strides are set on scales when they are not dense).
func rows(ts *Tensors, xd, sd Desc) (x, scales dlpack.Tensor) {
	if sd.NDim == NoneDim {
		return ts.Arg("x", xd, false, nil, -1, -1), dlpack.Tensor{}
	}
	x = ts.Arg("x[0]", xd, false, nil, -1, -1)
	if ts.Err != nil {
		return x, dlpack.Tensor{}
	}
	if x.DType.Size() != 1 {
		ts.Err = Argf("x[0]: dtype %s, expected 1-byte elements with scales (torch.float8_e4m3fn)", dtypeName(xd.DType))
		return dlpack.Tensor{}, dlpack.Tensor{}
	}
	scales = ts.ArgStrided("x[1]", sd, false, scaleTypes, x.Shape[0], -1)
	if ts.Err != nil {
		return x, dlpack.Tensor{}
	}
	st, ss, err := scaleStrides("x[1]", sd)
	if err != nil {
		ts.Err = err
		return x, dlpack.Tensor{}
	}
	if st != scales.Shape[1] || ss != 1 {
		scales.Strides = []int64{st, ss}
	}
	return x, scales
}

// scaleStride is stride i of checked scales, 0 for dense ones (the engines' row-major default).
func scaleStride(scales dlpack.Tensor, i int) int {
	if scales.Strides == nil {
		return 0
	}
	return int(scales.Strides[i])
}

// scaleStrides are the token and scale strides, in elements, of FP8 scales [T, S]: row-major, or
// column-major as DeepGEMM makes them for TMA (strides (1, T)), which DeepEP reads by stride; the
// outer stride may be padded. The stride of a dimension of size 1 does not matter.
func scaleStrides(name string, d Desc) (tokenStride, scaleStride int64, err error) {
	T, S := d.Size[0], d.Size[1]
	st, ss := d.Stride[0], d.Stride[1]
	if T <= 1 {
		st = 1
	}
	if S <= 1 {
		ss = 1
	}
	rowMajor := ss == 1 && st >= S
	colMajor := st == 1 && ss >= T
	if !rowMajor && !colMajor || max(st, ss) > math.MaxInt32 {
		return 0, 0, Argf("%s: strides (%d, %d) for shape [%d, %d]: expected row-major (%d, 1) or column-major (1, %d) "+
			"scales (the larger stride may be padded, up to %d)", name, d.Stride[0], d.Stride[1], T, S, S, T, math.MaxInt32)
	}
	return st, ss, nil
}

// dispatchCall is what a dispatch checks and runs, in one allocation: 2.5 KB with pointers, which
// cost about a microsecond a call to allocate and collect, so a call whose data phase was queued
// (nothing keeps it: the engine copied what it launches) goes back to dispatchCalls.
type dispatchCall struct {
	ts Tensors
	n  NotifyOp
	d  DispatchOp
}

var dispatchCalls = sync.Pool{New: func() any { return new(dispatchCall) }}

// checkDispatch checks a dispatch's arguments, in the order the Python layer did, and returns
// its notify and its dispatch without the recv tensors (see withRecv).
func (b *Buffer) checkDispatch(a *DispatchArgs) (*dispatchCall, error) {
	if err := b.errMultiDomain(); err != nil {
		return nil, err
	}
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	call := dispatchCalls.Get().(*dispatchCall)
	*call = dispatchCall{}
	ts := &call.ts
	b.initTensors(ts)
	x, scales := rows(ts, a.X, a.XScales)
	switch {
	case ts.Err != nil:
		return nil, ts.Err
	case x.Shape[0] > MaxRows:
		return nil, Argf("x: %d tokens, expected at most %d", x.Shape[0], MaxRows)
	case a.ExpertAlignment < 1:
		return nil, Argf("expert_alignment = %d: expected an int >= 1", a.ExpertAlignment)
	case a.ExpertAlignment > MaxExpertAlignment:
		return nil, Argf("expert_alignment = %d: expected at most %d", a.ExpertAlignment, MaxExpertAlignment)
	case a.NumWorstTokens < 0:
		return nil, Argf("num_worst_tokens = %d: expected an int >= 0", a.NumWorstTokens)
	case a.NumWorstTokens > MaxRows:
		return nil, Argf("num_worst_tokens = %d: expected at most %d", a.NumWorstTokens, MaxRows)
	}
	if err := a.Order.check(); err != nil {
		return nil, err
	}
	for _, l := range []struct {
		name string
		d    Desc
	}{{"num_tokens_per_rank", a.PerRank}, {"is_token_in_rank", a.InRank}, {"num_tokens_per_expert", a.PerExpert}} {
		if l.d.NDim == NoneDim {
			return nil, Argf("%s: required without a handle (from get_dispatch_layout)", l.name)
		}
	}
	T := x.Shape[0]
	perRank := ts.Arg("num_tokens_per_rank", a.PerRank, false, i32, R)
	inRank := ts.Arg("is_token_in_rank", a.InRank, false, bool_, T, R)
	perExpert := ts.Arg("num_tokens_per_expert", a.PerExpert, false, i32, -1)
	if ts.Err != nil {
		return nil, ts.Err
	}
	E := perExpert.Shape[0]
	if E == 0 || E%R != 0 {
		return nil, Argf("num_tokens_per_expert: %d experts, expected a positive multiple of num_ranks = %d", E, R)
	}
	if (a.TopkIdx.NDim == NoneDim) != (a.TopkWeights.NDim == NoneDim) {
		return nil, Argf("topk_idx, topk_weights: pass both or neither")
	}
	topk := topkArg(ts, a.TopkIdx, true, T)
	K := int64(0)
	if topk.Valid {
		K = topk.Shape[1]
	}
	if K > MaxTopK {
		return nil, Argf("topk_idx: %d experts per token, expected at most %d", K, MaxTopK)
	}
	weights := ts.Arg("topk_weights", a.TopkWeights, true, f32, T, K)
	n := &call.n
	*n = NotifyOp{Config: a.Config, NumTokens: int(T), NumExperts: int(E), ExpertAlignment: a.ExpertAlignment,
		NumWorstTokens: a.NumWorstTokens, PerRank: perRank, PerExpert: perExpert, InRank: inRank, TopkIdx: topk, Order: a.Order}
	n.RankPrefix = ts.Own("rank_prefix_matrix", a.RankPrefix, false, dlpack.I32, R, R)
	n.ChannelPrefix = ts.Own("channel_prefix_matrix", a.ChannelPrefix, false, dlpack.I32, R, C)
	n.RecvChannelPrefix = ts.Own("recv_channel_prefix_matrix", a.RecvChannelPrefix, false, dlpack.I32, R, C)
	n.RecvPerExpert = ts.Own("num_recv_tokens_per_expert", a.RecvPerExpert, false, dlpack.I32, E/R)
	sendHead := ts.Own("send_head", a.SendHead, false, dlpack.I32, T, R)
	if ts.Err != nil {
		return nil, ts.Err
	}
	call.d = DispatchOp{Config: a.Config, NumTokens: int(T), HiddenBytes: RowBytes(x), ScalesBytes: RowBytes(scales), ScalesTokenStride: scaleStride(scales, 0), ScalesStride: scaleStride(scales, 1),
		NumTopk: int(K), NumExperts: int(E), NumWorstTokens: a.NumWorstTokens,
		X: x, XScales: scales, TopkIdx: topk, TopkWeights: weights, InRank: inRank, RankPrefix: n.RankPrefix,
		ChannelPrefix: n.ChannelPrefix, RecvChannelPrefix: n.RecvChannelPrefix, SendHead: sendHead, Order: a.Order}
	return call, nil
}

// withRecv sets d's recv tensors: r.Rows rows at r's addresses.
func withRecv(ts *Tensors, d *DispatchOp, r RecvTensors) error {
	N, H := int64(r.Rows), int64(d.X.Shape[1])
	d.RecvX = ts.Own("recv_x", r.X, false, d.X.DType, N, H)
	if d.XScales.Valid {
		d.RecvXScales = ts.Own("recv_x_scales", r.XScales, false, d.XScales.DType, N, d.XScales.Shape[1])
	}
	if d.TopkIdx.Valid || d.SendHead.Valid {
		d.RecvSrcIdx = ts.Own("recv_src_idx", r.SrcIdx, false, dlpack.I32, N)
	}
	if d.NumTopk > 0 {
		d.RecvTopkIdx = ts.Own("recv_topk_idx", r.TopkIdx, false, dlpack.I64, N, int64(d.NumTopk))
		d.RecvTopkWeights = ts.Own("recv_topk_weights", r.TopkWeights, false, dlpack.F32, N, int64(d.NumTopk))
	}
	return ts.Err
}

// DispatchNotify checks a dispatch and runs its notify; it returns the rows this rank receives.
// The data phase follows with DispatchRecv, into recv tensors of that many rows (or
// num_worst_tokens).
func (b *Buffer) DispatchNotify(a *DispatchArgs) (int, error) {
	call, err := b.checkDispatch(a)
	if err != nil {
		return 0, err
	}
	rows, err := b.notify(&call.n)
	if err != nil {
		return 0, err
	}
	if a.NumWorstTokens > 0 {
		rows = a.NumWorstTokens
	}
	b.setPending(&call.d, rows)
	return rows, b.copyCounts(&call.n, a.Counts)
}

// copyCounts writes num_recv_tokens_per_expert of the notify n that just ran to dst.
func (b *Buffer) copyCounts(n *NotifyOp, dst uintptr) error {
	if dst == 0 {
		return nil
	}
	counts := Int32s(n.RecvPerExpert)
	if pc, ok := b.normalOrNil().(PerExpertCounter); ok {
		var err error
		if counts, err = pc.RecvPerExpert(); err != nil {
			return err
		}
	}
	copy(unsafe.Slice((*int32)(dlpack.Pointer(dst)), len(counts)), counts)
	return nil
}

func (b *Buffer) notify(n *NotifyOp) (int, error) {
	eng, peers, err := b.engine()
	if err != nil {
		return 0, err
	}
	rows, err := eng.Notify(peers, n)
	return rows, wrap(err)
}

// DispatchQueued checks a dispatch and runs its notify and, without waiting for the counts where
// the engine can (SpeculativeEngine), its data phase into recv tensors of r.Rows rows (the most
// this rank may receive). It returns the rows this rank receives and whether the data phase ran:
// if some rank's rows exceeded what it allocated, it did not, and DispatchRecv into exact rows
// follows. With an engine that cannot queue it, the data phase runs after the counts, when this rank's
// rows fit.
func (b *Buffer) DispatchQueued(a *DispatchArgs, r RecvTensors) (int, bool, error) {
	call, err := b.checkDispatch(a)
	if err != nil {
		return 0, false, err
	}
	n, d := &call.n, &call.d
	if a.NumWorstTokens != 0 {
		return 0, false, Argf("num_worst_tokens = %d: a queued dispatch has none", a.NumWorstTokens)
	}
	if err := withRecv(&call.ts, d, r); err != nil {
		return 0, false, err
	}
	eng, peers, err := b.engine()
	if err != nil {
		return 0, false, err
	}
	se, ok := eng.(SpeculativeEngine)
	if !ok {
		rows, err := b.notify(n)
		if err != nil {
			return 0, false, err
		}
		if err := b.copyCounts(n, a.Counts); err != nil {
			return 0, false, err
		}
		if rows > r.Rows {
			// The data phase is a collective that waits for every rank: this one joins it later.
			b.setPending(d, rows)
			return rows, false, nil
		}
		r.Rows = rows
		if err := withRecv(&call.ts, d, r); err != nil {
			return 0, false, err
		}
		return rows, true, b.dispatch(d)
	}
	n.Capacity = r.Rows // the engine checks it against recv_x's rows
	rows, ran, err := se.NotifyDispatch(peers, n, d)
	if err != nil {
		return 0, false, wrap(err)
	}
	if !ran {
		b.setPending(d, rows)
		return rows, ran, b.copyCounts(n, a.Counts)
	}
	err = b.copyCounts(n, a.Counts)
	dispatchCalls.Put(call)
	return rows, ran, err
}

// setPending keeps the dispatch whose notify ran, for DispatchRecv: its caller's tensors stay
// alive in the Python call that made both.
func (b *Buffer) setPending(d *DispatchOp, rows int) {
	b.mu.Lock()
	b.pending, b.pendingRows = d, rows
	b.mu.Unlock()
}

// DispatchRecv runs the data phase of the dispatch whose notify DispatchNotify or DispatchQueued
// ran, into recv tensors of the rows they returned.
func (b *Buffer) DispatchRecv(r RecvTensors, order StreamOrder) error {
	b.mu.Lock()
	d, rows := b.pending, b.pendingRows
	b.pending = nil
	b.mu.Unlock()
	switch {
	case d == nil:
		return errors.New("dispatch: no notify awaits its data phase")
	case r.Rows != rows:
		return Argf("dispatch: %d rows allocated for the %d received", r.Rows, rows)
	}
	d.Order = order
	if err := withRecv(b.tensors(), d, r); err != nil {
		return err
	}
	return b.dispatch(d)
}

// DispatchCached dispatches x again with the layout of an earlier dispatch's handle.
func (b *Buffer) DispatchCached(a *CachedDispatchArgs) error {
	if err := b.errMultiDomain(); err != nil {
		return err
	}
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	ts := b.tensors()
	x, scales := rows(ts, a.X, a.XScales)
	if ts.Err != nil {
		return ts.Err
	}
	if err := a.Order.check(); err != nil {
		return err
	}
	T := x.Shape[0]
	switch {
	case T != int64(a.NumTokens):
		return Argf("handle is_token_in_rank: shape [%d, %d], expected [%d, %d]", a.NumTokens, R, T, R)
	case C != int64(a.NumChannels):
		return Argf("config: %d channels, the handle's dispatch used %d", C, a.NumChannels)
	}
	// The handle's rows: num_worst_tokens of its dispatch, padding included.
	d := &DispatchOp{Config: a.Config, NumTokens: int(T), HiddenBytes: RowBytes(x), ScalesBytes: RowBytes(scales), ScalesTokenStride: scaleStride(scales, 0), ScalesStride: scaleStride(scales, 1),
		NumWorstTokens: a.NumRecv, X: x, XScales: scales, Order: a.Order}
	d.InRank = ts.Own("is_token_in_rank", a.InRank, false, dlpack.BoolT, T, R)
	d.RankPrefix = ts.Own("rank_prefix_matrix", a.RankPrefix, false, dlpack.I32, R, R)
	d.ChannelPrefix = ts.Own("channel_prefix_matrix", a.ChannelPrefix, false, dlpack.I32, R, C)
	if ts.Err != nil {
		return ts.Err
	}
	if err := withRecv(ts, d, RecvTensors{Rows: a.NumRecv, X: a.RecvX, XScales: a.RecvXScales}); err != nil {
		return err
	}
	return b.dispatch(d)
}

// dispatch runs a checked data phase.
func (b *Buffer) dispatch(op *DispatchOp) error {
	eng, peers, err := b.engine()
	if err != nil {
		return err
	}
	return wrap(eng.Dispatch(peers, op))
}
