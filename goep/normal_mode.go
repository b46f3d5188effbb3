package goep

import (
	"errors"
	"math"
	"os"
	"strconv"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// The normal-mode operations of a Buffer: layout, notify (the count exchange of a dispatch),
// dispatch (also cached) and combine. The caller's tensors arrive as DLPack addresses, and the
// tensors the pyep layer allocated (outputs, a handle's tensors) as data addresses (see
// Tensors). On the cpu backend the data moves through the peers' shared regions
// (goep/normal).

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
	// Dispatch moves rows as opaque bytes, of any element type (nil), as DeepEP's does.
	anyRow []dlpack.DType
	// FP8 scales: float32, or int32 (packed UE8M0), which DeepEP takes too.
	scaleTypes = []dlpack.DType{dlpack.F32, dlpack.I32}
	// Rows that combine sums.
	sumRow = []dlpack.DType{dlpack.BF16, dlpack.F16, dlpack.F32}
)

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
	if id := b.backend.DeviceID(); id >= 0 {
		return &Tensors{DeviceType: dlpack.CUDA, DeviceID: id}
	}
	return &Tensors{DeviceType: dlpack.CPU}
}

// wrap marks the engine's argument errors as the caller's.
func wrap(err error) error {
	if err != nil && errors.Is(err, normal.ErrInvalid) {
		return &ArgumentError{err.Error()}
	}
	return err
}

// LayoutOp is a checked get_dispatch_layout: topk_idx [T, K] int64 in; num_tokens_per_rank [R],
// num_tokens_per_expert [E] int32 and is_token_in_rank [T, R] bool out.
type LayoutOp struct {
	NumExperts, NumRanks                int
	TopkIdx, PerRank, PerExpert, InRank dlpack.Tensor
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
}

// DispatchOp is a checked dispatch (see normal.DispatchArgs); TopkIdx is absent when cached.
// XScales may be strided: scale j of token t is element t*ScalesTokenStride + j*ScalesStride.
type DispatchOp struct {
	Config                                       Config
	NumTokens, HiddenBytes, ScalesBytes, NumTopk int
	ScalesTokenStride, ScalesStride              int
	NumExperts, NumWorstTokens                   int
	X, XScales, TopkIdx, TopkWeights, InRank     dlpack.Tensor
	RankPrefix, ChannelPrefix                    dlpack.Tensor
	RecvX, RecvXScales, RecvSrcIdx, RecvTopkIdx  dlpack.Tensor
	RecvTopkWeights, RecvChannelPrefix, SendHead dlpack.Tensor
}

// CombineOp is a checked combine (see normal.CombineArgs).
type CombineOp struct {
	Config                                       Config
	NumTokens, Hidden, NumTopk                   int
	X, TopkWeights, SrcIdx                       dlpack.Tensor
	RankPrefix, ChannelPrefix, SendHead          dlpack.Tensor
	Bias0, Bias1, CombinedX, CombinedTopkWeights dlpack.Tensor
}

// NormalEngine runs normal-mode operations on a backend whose memory the host cannot address
// (cuda kernels); without one, the cpu path runs goep/normal over the mapped regions. peers[i]
// is NVLink rank i's region as mapped here.
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

// Layout counts, for topk_idx [T, K] (DLPack), the tokens for each rank and expert and which
// ranks each token goes to, into num_tokens_per_rank [R] and num_tokens_per_expert [E] int32
// and is_token_in_rank [T, R] bool (data addresses).
func (b *Buffer) Layout(topkIdx uintptr, numExperts int, perRank, perExpert, inRank uintptr) error {
	R := int64(b.topo.NumRanks)
	if numExperts <= 0 || numExperts%int(R) != 0 {
		return Argf("num_experts = %d: expected a positive multiple of num_ranks = %d", numExperts, R)
	}
	ts := b.tensors()
	op := &LayoutOp{NumExperts: numExperts, NumRanks: int(R)}
	op.TopkIdx = ts.Get("topk_idx", topkIdx, false, i64, -1, -1)
	T := int64(0)
	if ts.Err == nil {
		T = op.TopkIdx.Shape[0]
	}
	op.PerRank = ts.Own("num_tokens_per_rank", perRank, false, dlpack.I32, R)
	op.PerExpert = ts.Own("num_tokens_per_expert", perExpert, false, dlpack.I32, int64(numExperts))
	op.InRank = ts.Own("is_token_in_rank", inRank, false, dlpack.BoolT, T, R)
	if ts.Err != nil {
		return ts.Err
	}
	if e, ok := b.backend.(NormalEngine); ok {
		return wrap(e.Layout(op))
	}
	if b.backend.DeviceID() >= 0 {
		return errors.New("get_dispatch_layout is not available on this backend")
	}
	return wrap(normal.Layout(Int64s(op.TopkIdx), int(T), int(op.TopkIdx.Shape[1]), numExperts, int(R),
		Int32s(op.PerRank), Int32s(op.PerExpert), Bools(op.InRank)))
}

// NotifyArgs are the tensors of a dispatch's count exchange: the layout's and TopkIdx as DLPack
// addresses, the matrices and NumRecvTokensPerExpert as data addresses.
type NotifyArgs struct {
	Config                                              Config
	NumExperts, ExpertAlignment, NumWorstTokens         int
	NumTokensPerRank, NumTokensPerExpert, IsTokenInRank uintptr
	RankPrefixMatrix, ChannelPrefixMatrix               uintptr
	RecvChannelPrefixMatrix, NumRecvTokensPerExpert     uintptr
	TopkIdx                                             uintptr // optional: the dispatch's topk_idx
}

// Notify exchanges a dispatch's counts with every peer and returns how many rows this rank
// receives.
func (b *Buffer) Notify(a NotifyArgs) (int, error) {
	op, err := b.notifyOp(a)
	if err != nil {
		return 0, err
	}
	eng, peers, err := b.engine()
	if err != nil {
		return 0, err
	}
	if eng != nil {
		n, err := eng.Notify(b.topo, peers, op)
		return n, wrap(err)
	}
	res, err := normal.Notify(b.domain(peers), &normal.NotifyArgs{
		Config: a.Config.normal(), NumTokens: op.NumTokens, NumExperts: a.NumExperts,
		ExpertAlignment: a.ExpertAlignment, NumWorstTokens: a.NumWorstTokens,
		NumTokensPerRank: Int32s(op.PerRank), NumTokensPerExpert: Int32s(op.PerExpert), IsTokenInRank: Bools(op.InRank),
		RankPrefixMatrix: Int32s(op.RankPrefix), ChannelPrefixMatrix: Int32s(op.ChannelPrefix),
		RecvChannelPrefixMatrix: Int32s(op.RecvChannelPrefix), NumRecvTokensPerExpert: Int32s(op.RecvPerExpert),
	})
	return res.NumRecvTokens, wrap(err)
}

// NotifyDispatch is Notify and, queued behind it before its answer, Dispatch into rows
// allocated for capacity tokens (see SpeculativeEngine): the host's wait for the counts no
// longer delays the data. It returns the rows this rank receives and whether the dispatch ran;
// if not (some rank's rows did not fit), Dispatch into exact rows follows.
func (b *Buffer) NotifyDispatch(capacity int, na NotifyArgs, da DispatchArgs) (int, bool, error) {
	n, err := b.notifyOp(na)
	if err != nil {
		return 0, false, err
	}
	d, err := b.dispatchOp(da)
	if err != nil {
		return 0, false, err
	}
	n.Capacity = capacity // the engine checks it against recv_x's rows
	eng, peers, err := b.engine()
	if err != nil {
		return 0, false, err
	}
	se, ok := eng.(SpeculativeEngine)
	if !ok {
		return 0, false, errors.New("a dispatch queued behind its notify is not available on this backend")
	}
	rows, ran, err := se.NotifyDispatch(b.topo, peers, n, d)
	return rows, ran, wrap(err)
}

// notifyOp checks a notify's arguments.
func (b *Buffer) notifyOp(a NotifyArgs) (*NotifyOp, error) {
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	if a.NumExperts <= 0 || a.NumExperts%int(R) != 0 {
		return nil, Argf("num_tokens_per_expert: %d experts, expected a positive multiple of num_ranks = %d", a.NumExperts, R)
	}
	ts := b.tensors()
	op := &NotifyOp{Config: a.Config, NumExperts: a.NumExperts, ExpertAlignment: a.ExpertAlignment, NumWorstTokens: a.NumWorstTokens}
	op.InRank = ts.Get("is_token_in_rank", a.IsTokenInRank, false, bool_, -1, R)
	op.PerRank = ts.Get("num_tokens_per_rank", a.NumTokensPerRank, false, i32, R)
	op.PerExpert = ts.Get("num_tokens_per_expert", a.NumTokensPerExpert, false, i32, int64(a.NumExperts))
	op.RankPrefix = ts.Own("rank_prefix_matrix", a.RankPrefixMatrix, false, dlpack.I32, R, R)
	op.ChannelPrefix = ts.Own("channel_prefix_matrix", a.ChannelPrefixMatrix, false, dlpack.I32, R, C)
	op.RecvChannelPrefix = ts.Own("recv_channel_prefix_matrix", a.RecvChannelPrefixMatrix, false, dlpack.I32, R, C)
	op.RecvPerExpert = ts.Own("num_recv_tokens_per_expert", a.NumRecvTokensPerExpert, false, dlpack.I32, int64(a.NumExperts)/R)
	if ts.Err == nil {
		op.TopkIdx = ts.Get("topk_idx", a.TopkIdx, true, i64, op.InRank.Shape[0], -1)
	}
	if ts.Err != nil {
		return nil, ts.Err
	}
	op.NumTokens = int(op.InRank.Shape[0])
	return op, nil
}

// DispatchArgs are the tensors of a dispatch; a cached dispatch has no top-k tensors. X,
// XScales, TopkIdx, TopkWeights and IsTokenInRank are DLPack addresses; the others are data
// addresses, the recv tensors of NumRecv rows.
type DispatchArgs struct {
	Config                                             Config
	NumExperts, NumWorstTokens, NumRecv                int
	X, XScales, TopkIdx, TopkWeights, IsTokenInRank    uintptr
	RankPrefixMatrix, ChannelPrefixMatrix              uintptr
	RecvX, RecvXScales, RecvSrcIdx, RecvTopkIdx        uintptr
	RecvTopkWeights, RecvChannelPrefixMatrix, SendHead uintptr
}

// Dispatch moves every token to the ranks of its experts.
func (b *Buffer) Dispatch(a DispatchArgs) error {
	op, err := b.dispatchOp(a)
	if err != nil {
		return err
	}
	eng, peers, err := b.engine()
	if err != nil {
		return err
	}
	if eng != nil {
		return wrap(eng.Dispatch(b.topo, peers, op))
	}
	x, scales, topk, weights := op.X, op.XScales, op.TopkIdx, op.TopkWeights
	return wrap(normal.Dispatch(b.domain(peers), &normal.DispatchArgs{
		Config: a.Config.normal(), NumTokens: op.NumTokens, HiddenBytes: op.HiddenBytes, ScalesBytes: op.ScalesBytes,
		ScalesTokenStride: op.ScalesTokenStride, ScalesStride: op.ScalesStride, NumTopk: op.NumTopk, NumExperts: a.NumExperts,
		X: Bytes(x), XScales: Bytes(scales), TopkIdx: Int64s(topk), TopkWeights: Float32s(weights), IsTokenInRank: Bools(op.InRank),
		RankPrefixMatrix: Int32s(op.RankPrefix), ChannelPrefixMatrix: Int32s(op.ChannelPrefix), NumWorstTokens: a.NumWorstTokens,
		RecvX: Bytes(op.RecvX), RecvXScales: Bytes(op.RecvXScales), RecvSrcIdx: Int32s(op.RecvSrcIdx),
		RecvTopkIdx: Int64s(op.RecvTopkIdx), RecvTopkWeights: Float32s(op.RecvTopkWeights),
		RecvChannelPrefixMatrix: Int32s(op.RecvChannelPrefix), SendHead: Int32s(op.SendHead),
	}))
}

// dispatchOp checks a dispatch's arguments.
func (b *Buffer) dispatchOp(a DispatchArgs) (*DispatchOp, error) {
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	ts := b.tensors()
	x := ts.Get("x", a.X, false, anyRow, -1, -1)
	T, N, K, H := int64(0), int64(a.NumRecv), int64(0), int64(0)
	if ts.Err == nil {
		T, H = x.Shape[0], x.Shape[1]
	}
	scales := ts.GetStrided("x_scales", a.XScales, true, scaleTypes, T, -1)
	topk := ts.Get("topk_idx", a.TopkIdx, true, i64, T, -1)
	if topk.Valid {
		K = topk.Shape[1]
	}
	weights := ts.Get("topk_weights", a.TopkWeights, !topk.Valid, f32, T, K)
	ir := ts.Get("is_token_in_rank", a.IsTokenInRank, false, bool_, T, R)
	rpm := ts.Own("rank_prefix_matrix", a.RankPrefixMatrix, false, dlpack.I32, R, R)
	cpm := ts.Own("channel_prefix_matrix", a.ChannelPrefixMatrix, true, dlpack.I32, R, C)
	recvX := ts.Own("recv_x", a.RecvX, false, x.DType, N, H)
	var recvScales dlpack.Tensor
	if scales.Valid {
		recvScales = ts.Own("recv_x_scales", a.RecvXScales, false, scales.DType, N, scales.Shape[1])
	}
	srcIdx := ts.Own("recv_src_idx", a.RecvSrcIdx, true, dlpack.I32, N)
	var recvTopk, recvWeights dlpack.Tensor
	if K > 0 {
		recvTopk = ts.Own("recv_topk_idx", a.RecvTopkIdx, false, dlpack.I64, N, K)
		recvWeights = ts.Own("recv_topk_weights", a.RecvTopkWeights, false, dlpack.F32, N, K)
	}
	rcpm := ts.Own("recv_channel_prefix_matrix", a.RecvChannelPrefixMatrix, true, dlpack.I32, R, C)
	sendHead := ts.Own("send_head", a.SendHead, true, dlpack.I32, T, R)
	if ts.Err != nil {
		return nil, ts.Err
	}
	var st, ss int64
	if scales.Valid {
		if x.DType.Size() != 1 {
			return nil, Argf("x: elements of %d bytes (%v): with x_scales, expected 1-byte elements (FP8)", x.DType.Size(), x.DType)
		}
		var err error
		if st, ss, err = scaleStrides(scales); err != nil {
			return nil, err
		}
	}
	return &DispatchOp{Config: a.Config, NumTokens: int(T), HiddenBytes: RowBytes(x), ScalesBytes: RowBytes(scales),
		ScalesTokenStride: int(st), ScalesStride: int(ss),
		NumTopk: int(K), NumExperts: a.NumExperts, NumWorstTokens: a.NumWorstTokens,
		X: x, XScales: scales, TopkIdx: topk, TopkWeights: weights, InRank: ir, RankPrefix: rpm, ChannelPrefix: cpm,
		RecvX: recvX, RecvXScales: recvScales, RecvSrcIdx: srcIdx, RecvTopkIdx: recvTopk,
		RecvTopkWeights: recvWeights, RecvChannelPrefix: rcpm, SendHead: sendHead}, nil
}

// scaleStrides are the token and scale strides, in elements, of x_scales [T, S]: row-major, or
// column-major as DeepGEMM makes FP8 scales for TMA (strides (1, T)), which DeepEP reads by
// stride; the outer stride may be padded. The stride of a dimension of size 1 does not matter.
func scaleStrides(t dlpack.Tensor) (tokenStride, scaleStride int64, err error) {
	T, S := t.Shape[0], t.Shape[1]
	if t.Strides == nil {
		return S, 1, nil
	}
	st, ss := t.Strides[0], t.Strides[1]
	if T == 1 {
		st = 1
	}
	if S == 1 {
		ss = 1
	}
	rowMajor := ss == 1 && st >= S
	colMajor := st == 1 && ss >= T
	if !rowMajor && !colMajor || max(st, ss) > math.MaxInt32 {
		return 0, 0, Argf("x_scales: strides %v for shape %v: expected row-major (%d, 1) or column-major (1, %d) scales "+
			"(the larger stride may be padded, up to %d)", t.Strides, t.Shape, S, T, math.MaxInt32)
	}
	return st, ss, nil
}

// CombineArgs are the tensors of a combine: X, TopkWeights and the biases as DLPack
// addresses; the handle's tensors (SrcIdx [NumRecv], SendHead [NumTokens, R], the matrices) and
// the outputs as data addresses.
type CombineArgs struct {
	Config                                          Config
	NumTokens, NumRecv                              int
	X, TopkWeights, SrcIdx                          uintptr
	RankPrefixMatrix, ChannelPrefixMatrix, SendHead uintptr
	Bias0, Bias1, CombinedX, CombinedTopkWeights    uintptr
}

// Combine sends every received row back to its token's rank and sums the copies there.
func (b *Buffer) Combine(a CombineArgs) error {
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	ts := b.tensors()
	x := ts.Get("x", a.X, false, sumRow, -1, -1)
	rows, H, K := int64(0), int64(0), int64(0)
	if ts.Err == nil {
		rows, H = x.Shape[0], x.Shape[1]
	}
	weights := ts.Get("topk_weights", a.TopkWeights, true, f32, rows, -1)
	if weights.Valid {
		K = weights.Shape[1]
	}
	T := int64(a.NumTokens)
	srcIdx := ts.Own("src_idx", a.SrcIdx, false, dlpack.I32, int64(a.NumRecv))
	rpm := ts.Own("rank_prefix_matrix", a.RankPrefixMatrix, false, dlpack.I32, R, R)
	rcpm := ts.Own("channel_prefix_matrix", a.ChannelPrefixMatrix, false, dlpack.I32, R, C)
	sendHead := ts.Own("send_head", a.SendHead, false, dlpack.I32, T, R)
	same := []dlpack.DType{x.DType}
	bias0 := ts.Get("bias[0]", a.Bias0, true, same, T, H)
	bias1 := ts.Get("bias[1]", a.Bias1, true, same, T, H)
	out := ts.Own("combined_x", a.CombinedX, false, x.DType, T, H)
	var outWeights dlpack.Tensor
	if K > 0 {
		outWeights = ts.Own("combined_topk_weights", a.CombinedTopkWeights, false, dlpack.F32, T, K)
	}
	if ts.Err != nil {
		return ts.Err
	}
	if rows < int64(a.NumRecv) {
		return Argf("x: %d rows, expected the dispatch's %d received rows", rows, a.NumRecv)
	}
	op := &CombineOp{Config: a.Config, NumTokens: int(T), Hidden: int(H), NumTopk: int(K),
		X: x, TopkWeights: weights, SrcIdx: srcIdx, RankPrefix: rpm, ChannelPrefix: rcpm, SendHead: sendHead,
		Bias0: bias0, Bias1: bias1, CombinedX: out, CombinedTopkWeights: outWeights}
	eng, peers, err := b.engine()
	if err != nil {
		return err
	}
	if eng != nil {
		return wrap(eng.Combine(b.topo, peers, op))
	}
	return wrap(normal.Combine(b.domain(peers), &normal.CombineArgs{
		Config: a.Config.normal(), DType: combineDType(x.DType), Hidden: int(H), NumTopk: int(K), NumTokens: int(T),
		X: Bytes(x), TopkWeights: Float32s(weights), SrcIdx: Int32s(srcIdx),
		RankPrefixMatrix: Int32s(rpm), ChannelPrefixMatrix: Int32s(rcpm), SendHead: Int32s(sendHead),
		Bias0: Bytes(bias0), Bias1: Bytes(bias1), CombinedX: Bytes(out), CombinedTopkWeights: Float32s(outWeights),
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
