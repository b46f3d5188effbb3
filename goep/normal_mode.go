package goep

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// The normal-mode operations of a Buffer: layout, dispatch (notify, the count exchange, then the
// data phase; also cached) and combine. Every argument is checked here, once, with the messages
// users see: the caller's tensors arrive as Descs, the tensors the pyep layer allocated
// (outputs, a handle's tensors) as data addresses (see Tensors). On the cpu backend the data
// moves through the peers' shared regions (goep/normal); a NormalEngine (cuda) runs kernels.

// NormalConfig is the intranode part of a Config.
func (c Config) normal() normal.Config {
	return normal.Config{NumSMs: c.NumSMs, NumMaxNVLChunkedSendTokens: c.NumMaxNVLChunkedSendTokens,
		NumMaxNVLChunkedRecvTokens: c.NumMaxNVLChunkedRecvTokens}
}

var (
	i32   = []dlpack.DType{dlpack.I32}
	i64   = []dlpack.DType{dlpack.I64}
	f32   = []dlpack.DType{dlpack.F32}
	bool_ = []dlpack.DType{dlpack.BoolT}
	fp8   = []dlpack.DType{dlpack.FP8E4M3}
	// Rows that dispatch moves (FP8 comes with scales) and combine sums.
	rowTypes = []dlpack.DType{dlpack.BF16, dlpack.F16, dlpack.F32}
)

// StreamOrder is how a call orders its work on the communication stream against the caller's
// stream, DeepEP's stream semantics (cuda; the cpu backend has finished when a call returns).
// It travels in the call: torch's Stream objects and events cost microseconds more.
type StreamOrder struct {
	Stream uintptr // the caller's current stream, a raw CUstream of the buffer's GPU
	Event  uintptr // previous_event's CUevent, which the call's work waits for (0: none)
	Flags  int
}

// Flags of a StreamOrder.
const (
	OrderWait     = 1 // the call's work waits for what Stream holds (no previous_event)
	OrderJoin     = 2 // Stream waits for the call's work (not async_finish)
	OrderOnComm   = 4 // allocate_on_comm_stream=True, checked against the others
	OrderPrevious = 8 // previous_event was given
)

func (o StreamOrder) check() error {
	if o.Flags&OrderOnComm != 0 && (o.Flags&OrderPrevious == 0 || o.Flags&OrderJoin != 0) {
		return Argf("allocate_on_comm_stream=True needs previous_event and async_finish=True")
	}
	return nil
}

// opTimeout bounds every wait on a peer: PYEP_TIMEOUT_S seconds, 100 by default.
var opTimeout = func() time.Duration {
	if s, err := strconv.ParseFloat(os.Getenv("PYEP_TIMEOUT_S"), 64); err == nil && s > 0 {
		return time.Duration(s * float64(time.Second))
	}
	return normal.DefaultTimeout
}()

// domain is the cpu path's view of the mapped regions for one call.
func (b *Buffer) domain(peers []Region) *normal.Domain {
	d := &normal.Domain{Rank: b.topo.NVLRank, NumRanks: b.topo.NumNVLRanks, NumBytes: b.params.NumNVLBytes, Timeout: opTimeout,
		Buffers: make([]unsafe.Pointer, len(peers)), Controls: make([]unsafe.Pointer, len(peers))}
	for i, p := range peers {
		d.Buffers[i], d.Controls[i] = p.Data(), p.Control()
	}
	return d
}

func (b *Buffer) tensors() *Tensors {
	ts := &Tensors{}
	b.initTensors(ts)
	return ts
}

func (b *Buffer) initTensors(ts *Tensors) {
	if id := b.backend.DeviceID(); id >= 0 {
		ts.Device, ts.DeviceType, ts.DeviceID = DeviceCode(CUDADevice, id), dlpack.CUDA, id
	} else {
		ts.Device, ts.DeviceType = DeviceCode(CPUDevice, -1), dlpack.CPU
	}
}

// wrap marks the engine's argument errors as the caller's.
func wrap(err error) error {
	if err != nil && errors.Is(err, normal.ErrInvalid) {
		return &ArgumentError{msg: err.Error()}
	}
	return err
}

// LayoutOp is a checked get_dispatch_layout: topk_idx [T, K] int64 in; num_tokens_per_rank [R],
// num_tokens_per_expert [E] int32 and is_token_in_rank [T, R] bool out.
type LayoutOp struct {
	NumExperts, NumRanks                int
	TopkIdx, PerRank, PerExpert, InRank dlpack.Tensor
	Order                               StreamOrder
}

// NotifyOp is a checked count exchange of a dispatch (see normal.NotifyArgs for the tensors).
// TopkIdx [T, K] is optional: the dispatch's top-k indices, which an engine that cannot check
// them on the host checks here, before any rank moves data (the cpu path checks them in
// Dispatch).
type NotifyOp struct {
	Config                                       Config
	NumTokens, NumExperts, ExpertAlignment       int
	NumWorstTokens                               int
	PerRank, PerExpert, InRank                   dlpack.Tensor
	RankPrefix, ChannelPrefix, RecvChannelPrefix dlpack.Tensor
	RecvPerExpert                                dlpack.Tensor
	TopkIdx                                      dlpack.Tensor
	// Capacity is the rows allocated for a dispatch queued behind this notify
	// (SpeculativeEngine); 0 for a plain notify.
	Capacity int
	// Order is the stream order of the notify and of a dispatch queued behind it.
	Order StreamOrder
}

// DispatchOp is a checked dispatch (see normal.DispatchArgs); TopkIdx is absent when cached.
type DispatchOp struct {
	Config                                       Config
	NumTokens, HiddenBytes, ScalesBytes, NumTopk int
	NumExperts, NumWorstTokens                   int
	X, XScales, TopkIdx, TopkWeights, InRank     dlpack.Tensor
	RankPrefix, ChannelPrefix                    dlpack.Tensor
	RecvX, RecvXScales, RecvSrcIdx, RecvTopkIdx  dlpack.Tensor
	RecvTopkWeights, RecvChannelPrefix, SendHead dlpack.Tensor
	Order                                        StreamOrder
}

// CombineOp is a checked combine (see normal.CombineArgs).
type CombineOp struct {
	Config                                       Config
	NumTokens, Hidden, NumTopk                   int
	X, TopkWeights, SrcIdx                       dlpack.Tensor
	RankPrefix, ChannelPrefix, SendHead          dlpack.Tensor
	Bias0, Bias1, CombinedX, CombinedTopkWeights dlpack.Tensor
	Order                                        StreamOrder
}

// NormalEngine runs normal-mode operations on a backend whose memory the host cannot address
// (cuda kernels); without one, the cpu path runs goep/normal over the mapped regions. peers[i]
// is NVLink rank i's region as mapped here. The ops arrive checked; an engine orders its work
// after and before the caller's stream as their Order says.
type NormalEngine interface {
	Layout(a *LayoutOp) error
	Notify(topo Topology, peers []Region, a *NotifyOp) (int, error)
	Dispatch(topo Topology, peers []Region, a *DispatchOp) error
	Combine(topo Topology, peers []Region, a *CombineOp) error
}

// SpeculativeEngine is what a NormalEngine implements to queue a dispatch behind its notify,
// before the host learns the row count: into rows allocated for n.Capacity tokens, which the
// dispatch uses only if every rank's rows fit (the same verdict on every rank). It returns
// the rows this rank receives and whether the dispatch ran; if not, the caller dispatches
// again into exact rows, as after Notify.
type SpeculativeEngine interface {
	NotifyDispatch(topo Topology, peers []Region, n *NotifyOp, d *DispatchOp) (numRecv int, ran bool, err error)
}

func (b *Buffer) engine() (NormalEngine, []Region, error) {
	peers, err := b.Peers()
	if err != nil {
		return nil, nil, err
	}
	if b.topo.NumRDMARanks > 1 {
		return nil, nil, Argf("num_ranks = %d: normal mode across NVLink domains (internode) is not available yet; use at most %d ranks", b.topo.NumRanks, NumMaxNVLPeers)
	}
	e, ok := b.backend.(NormalEngine)
	if !ok && b.backend.DeviceID() >= 0 {
		// goep/normal reads and writes the regions from the host: device memory needs an engine.
		return nil, nil, errors.New("normal mode is not available on this backend")
	}
	return e, peers, nil
}

// LayoutArgs are get_dispatch_layout's: topk_idx, num_experts, and the outputs
// num_tokens_per_rank [R], num_tokens_per_expert [E] int32 and is_token_in_rank [T, R] bool
// (data addresses).
type LayoutArgs struct {
	TopkIdx                    Desc
	NumExperts                 int
	PerRank, PerExpert, InRank uintptr
	Order                      StreamOrder
}

// Layout counts, for topk_idx [T, K], the tokens for each rank and expert and which ranks each
// token goes to.
func (b *Buffer) Layout(a *LayoutArgs) error {
	R := int64(b.topo.NumRanks)
	ts := b.tensors()
	topk := ts.Arg("topk_idx", a.TopkIdx, false, i64, -1, -1)
	switch {
	case ts.Err != nil:
		return ts.Err
	case a.NumExperts < 1:
		return Argf("num_experts = %d: expected an int >= 1", a.NumExperts)
	case a.NumExperts%int(R) != 0:
		return Argf("num_experts = %d: expected a multiple of num_ranks = %d", a.NumExperts, R)
	}
	if err := a.Order.check(); err != nil {
		return err
	}
	T := topk.Shape[0]
	op := &LayoutOp{NumExperts: a.NumExperts, NumRanks: int(R), TopkIdx: topk, Order: a.Order}
	op.PerRank = ts.Own("num_tokens_per_rank", a.PerRank, false, dlpack.I32, R)
	op.PerExpert = ts.Own("num_tokens_per_expert", a.PerExpert, false, dlpack.I32, int64(a.NumExperts))
	op.InRank = ts.Own("is_token_in_rank", a.InRank, false, dlpack.BoolT, T, R)
	if ts.Err != nil {
		return ts.Err
	}
	if e, ok := b.backend.(NormalEngine); ok {
		return wrap(e.Layout(op))
	}
	if b.backend.DeviceID() >= 0 {
		return errors.New("get_dispatch_layout is not available on this backend")
	}
	return wrap(normal.Layout(Int64s(topk), int(T), int(topk.Shape[1]), a.NumExperts, int(R),
		Int32s(op.PerRank), Int32s(op.PerExpert), Bools(op.InRank)))
}

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
		return fmt.Errorf("dispatch across NVLink domains (%d ranks) is not available yet", b.topo.NumRanks)
	}
	return nil
}

// rows checks a dispatch's x: a tensor of rowTypes, or FP8 x[0] with its float32 scales x[1].
func rows(ts *Tensors, xd, sd Desc) (x, scales dlpack.Tensor) {
	if sd.NDim == NoneDim {
		return ts.Arg("x", xd, false, rowTypes, -1, -1), dlpack.Tensor{}
	}
	x = ts.Arg("x[0]", xd, false, fp8, -1, -1)
	if ts.Err != nil {
		return x, dlpack.Tensor{}
	}
	return x, ts.Arg("x[1]", sd, false, f32, x.Shape[0], -1)
}

// dispatchCall is what a dispatch checks and runs, in one allocation.
type dispatchCall struct {
	ts Tensors
	n  NotifyOp
	d  DispatchOp
}

// checkDispatch checks a dispatch's arguments, in the order the Python layer did, and returns
// its notify and its dispatch without the recv tensors (see withRecv).
func (b *Buffer) checkDispatch(a *DispatchArgs) (*dispatchCall, error) {
	if err := b.errMultiDomain(); err != nil {
		return nil, err
	}
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	call := &dispatchCall{}
	ts := &call.ts
	b.initTensors(ts)
	x, scales := rows(ts, a.X, a.XScales)
	switch {
	case ts.Err != nil:
		return nil, ts.Err
	case a.ExpertAlignment < 1:
		return nil, Argf("expert_alignment = %d: expected an int >= 1", a.ExpertAlignment)
	case a.NumWorstTokens < 0:
		return nil, Argf("num_worst_tokens = %d: expected an int >= 0", a.NumWorstTokens)
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
	topk := ts.Arg("topk_idx", a.TopkIdx, true, i64, T, -1)
	K := int64(0)
	if topk.Valid {
		K = topk.Shape[1]
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
	call.d = DispatchOp{Config: a.Config, NumTokens: int(T), HiddenBytes: RowBytes(x), ScalesBytes: RowBytes(scales),
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
		d.RecvXScales = ts.Own("recv_x_scales", r.XScales, false, dlpack.F32, N, d.XScales.Shape[1])
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
	call.n.Order.Flags &^= OrderJoin // the data phase joins
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

// perExpertCounter is what an engine implements that keeps the host's copy of the last notify's
// num_recv_tokens_per_expert of a region.
type perExpertCounter interface {
	RecvPerExpert(r Region) ([]int32, error)
}

// copyCounts writes num_recv_tokens_per_expert of the notify n that just ran to dst.
func (b *Buffer) copyCounts(n *NotifyOp, dst uintptr) error {
	if dst == 0 {
		return nil
	}
	counts := Int32s(n.RecvPerExpert)
	if pc, ok := b.backend.(perExpertCounter); ok {
		peers, err := b.Peers()
		if err != nil {
			return err
		}
		if counts, err = pc.RecvPerExpert(peers[b.topo.NVLRank]); err != nil {
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
	if eng != nil {
		rows, err := eng.Notify(b.topo, peers, n)
		return rows, wrap(err)
	}
	res, err := normal.Notify(b.domain(peers), &normal.NotifyArgs{
		Config: n.Config.normal(), NumTokens: n.NumTokens, NumExperts: n.NumExperts,
		ExpertAlignment: n.ExpertAlignment, NumWorstTokens: n.NumWorstTokens,
		NumTokensPerRank: Int32s(n.PerRank), NumTokensPerExpert: Int32s(n.PerExpert), IsTokenInRank: Bools(n.InRank),
		RankPrefixMatrix: Int32s(n.RankPrefix), ChannelPrefixMatrix: Int32s(n.ChannelPrefix),
		RecvChannelPrefixMatrix: Int32s(n.RecvChannelPrefix), NumRecvTokensPerExpert: Int32s(n.RecvPerExpert),
	})
	return res.NumRecvTokens, wrap(err)
}

// DispatchQueued checks a dispatch and runs its notify and, without waiting for the counts where
// the engine can (SpeculativeEngine), its data phase into recv tensors of r.Rows rows (the most
// this rank may receive). It returns the rows this rank receives and whether the data phase ran:
// if some rank's rows exceeded what it allocated, it did not, and DispatchRecv into exact rows
// follows. On the cpu path the data phase runs after the counts, when this rank's rows fit.
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
	if eng == nil {
		n.Order.Flags &^= OrderJoin
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
	se, ok := eng.(SpeculativeEngine)
	if !ok {
		return 0, false, errors.New("a dispatch queued behind its notify is not available on this backend")
	}
	n.Capacity = r.Rows // the engine checks it against recv_x's rows
	rows, ran, err := se.NotifyDispatch(b.topo, peers, n, d)
	if err != nil {
		return 0, false, wrap(err)
	}
	if !ran {
		b.setPending(d, rows)
	}
	return rows, ran, b.copyCounts(n, a.Counts)
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
	d := &DispatchOp{Config: a.Config, NumTokens: int(T), HiddenBytes: RowBytes(x), ScalesBytes: RowBytes(scales),
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
	if eng != nil {
		return wrap(eng.Dispatch(b.topo, peers, op))
	}
	return wrap(normal.Dispatch(b.domain(peers), &normal.DispatchArgs{
		Config: op.Config.normal(), NumTokens: op.NumTokens, HiddenBytes: op.HiddenBytes, ScalesBytes: op.ScalesBytes,
		NumTopk: op.NumTopk, NumExperts: op.NumExperts,
		X: Bytes(op.X), XScales: Bytes(op.XScales), TopkIdx: Int64s(op.TopkIdx), TopkWeights: Float32s(op.TopkWeights),
		IsTokenInRank: Bools(op.InRank), RankPrefixMatrix: Int32s(op.RankPrefix), ChannelPrefixMatrix: Int32s(op.ChannelPrefix),
		NumWorstTokens: op.NumWorstTokens, RecvX: Bytes(op.RecvX), RecvXScales: Bytes(op.RecvXScales),
		RecvSrcIdx: Int32s(op.RecvSrcIdx), RecvTopkIdx: Int64s(op.RecvTopkIdx), RecvTopkWeights: Float32s(op.RecvTopkWeights),
		RecvChannelPrefixMatrix: Int32s(op.RecvChannelPrefix), SendHead: Int32s(op.SendHead),
	}))
}

// CombineArgs are a combine's: the caller's tensors, the handle's tensors (data addresses) and
// sizes, and the outputs.
type CombineArgs struct {
	Config                       Config
	X, TopkWeights, Bias0, Bias1 Desc
	// The handle's send_head rows, recv_channel_prefix_matrix columns and recv_src_idx rows.
	NumTokens, NumChannels, NumRecv             int
	SrcIdx, RankPrefix, ChannelPrefix, SendHead uintptr
	CombinedX, CombinedTopkWeights              uintptr
	Order                                       StreamOrder
}

// Combine sends every received row back to its token's rank and sums the copies there.
func (b *Buffer) Combine(a *CombineArgs) error {
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	ts := b.tensors()
	x := ts.Arg("x", a.X, false, rowTypes, -1, -1)
	if ts.Err != nil {
		return ts.Err
	}
	rows, H, K, T := x.Shape[0], x.Shape[1], int64(0), int64(a.NumTokens)
	switch {
	case rows < int64(a.NumRecv):
		return Argf("x: %d rows, expected the dispatch's %d received rows", rows, a.NumRecv)
	case C != int64(a.NumChannels):
		return Argf("config: %d channels, the handle's dispatch used %d (num_sms = %d)", C, a.NumChannels, 2*a.NumChannels)
	}
	weights := ts.Arg("topk_weights", a.TopkWeights, true, f32, rows, -1)
	if weights.Valid {
		K = weights.Shape[1]
	}
	same := []dlpack.DType{x.DType}
	bias0 := ts.Arg("bias[0]", a.Bias0, true, same, T, H)
	bias1 := ts.Arg("bias[1]", a.Bias1, true, same, T, H)
	if ts.Err != nil {
		return ts.Err
	}
	if err := a.Order.check(); err != nil {
		return err
	}
	op := &CombineOp{Config: a.Config, NumTokens: int(T), Hidden: int(H), NumTopk: int(K),
		X: x, TopkWeights: weights, Bias0: bias0, Bias1: bias1, Order: a.Order}
	op.SrcIdx = ts.Own("src_idx", a.SrcIdx, false, dlpack.I32, int64(a.NumRecv))
	op.RankPrefix = ts.Own("rank_prefix_matrix", a.RankPrefix, false, dlpack.I32, R, R)
	op.ChannelPrefix = ts.Own("channel_prefix_matrix", a.ChannelPrefix, false, dlpack.I32, R, C)
	op.SendHead = ts.Own("send_head", a.SendHead, false, dlpack.I32, T, R)
	op.CombinedX = ts.Own("combined_x", a.CombinedX, false, x.DType, T, H)
	if K > 0 {
		op.CombinedTopkWeights = ts.Own("combined_topk_weights", a.CombinedTopkWeights, false, dlpack.F32, T, K)
	}
	if ts.Err != nil {
		return ts.Err
	}
	eng, peers, err := b.engine()
	if err != nil {
		return err
	}
	if eng != nil {
		return wrap(eng.Combine(b.topo, peers, op))
	}
	return wrap(normal.Combine(b.domain(peers), &normal.CombineArgs{
		Config: a.Config.normal(), DType: combineDType(x.DType), Hidden: int(H), NumTopk: int(K), NumTokens: int(T),
		X: Bytes(x), TopkWeights: Float32s(weights), SrcIdx: Int32s(op.SrcIdx),
		RankPrefixMatrix: Int32s(op.RankPrefix), ChannelPrefixMatrix: Int32s(op.ChannelPrefix), SendHead: Int32s(op.SendHead),
		Bias0: Bytes(bias0), Bias1: Bytes(bias1), CombinedX: Bytes(op.CombinedX), CombinedTopkWeights: Float32s(op.CombinedTopkWeights),
	}))
}

func combineDType(d dlpack.DType) normal.DType {
	switch d {
	case dlpack.F16:
		return normal.Float16
	case dlpack.F32:
		return normal.Float32
	}
	return normal.BFloat16
}
