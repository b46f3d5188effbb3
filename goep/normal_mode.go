package goep

import (
	"errors"
	"slices"

	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// The normal-mode operations of a Buffer: layout, dispatch (notify, the count exchange, then the
// data phase; also cached) and combine. Every argument is checked here, once, with the messages
// users see: the caller's tensors arrive as Descs, the tensors the pyep layer allocated
// (outputs, a handle's tensors) as data addresses (see Tensors). The buffer's NormalEngine runs
// the checked op: goep/cpu's moves the data through the peers' shared regions (goep/normal),
// goep/cuda's runs kernels.

var (
	i32   = []dlpack.DType{dlpack.I32}
	i64   = []dlpack.DType{dlpack.I64}
	f32   = []dlpack.DType{dlpack.F32}
	bool_ = []dlpack.DType{dlpack.BoolT}
	// FP8 scales: float32, or int32 (packed UE8M0), which DeepEP takes too.
	scaleTypes = []dlpack.DType{dlpack.F32, dlpack.I32}
	// Rows that combine sums; dispatch moves rows of any dtype.
	rowTypes = []dlpack.DType{dlpack.BF16, dlpack.F16, dlpack.F32}
)

// StreamOrder is how a call orders its work against the caller's stream, DeepEP's stream
// semantics (cuda; the cpu backend has finished when a call returns). The cuda engine runs the
// usual call (OrderWait|OrderJoin, no Event) on Stream itself, which orders it as DeepEP's two
// waits would, and the others on the communication stream with those waits
// (goep/cuda/normal/order.go). It travels in the call: torch's Stream objects and events cost
// microseconds more.
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

// topkArg checks a topk_idx [T, K]: int64, DeepEP's default topk_idx_t; a build of DeepEP with
// TOPK_IDX_BITS=32 takes int32, which no kernel of pyep's has a variant for, so the message says
// how to convert.
func topkArg(ts *Tensors, d Desc, optional bool, T int64) dlpack.Tensor {
	if ts.Err == nil && d.NDim != NoneDim && d.DType != int64Index {
		ts.Err = Argf("topk_idx: dtype %s, expected torch.int64 (pyep.topk_idx_t, as DeepEP's default build; convert "+
			"with .to(pyep.topk_idx_t))", dtypeName(d.DType))
		return dlpack.Tensor{}
	}
	return ts.Arg("topk_idx", d, optional, i64, T, -1)
}

// int64Index is torch.int64's index in DTypeNames.
var int64Index = slices.Index(DTypeNames, "int64")

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
	// Order is the stream order of the notify and of a dispatch queued behind it. A notify alone
	// (NormalEngine.Notify) never joins Stream, whatever OrderJoin says: the data phase that
	// follows it does (DispatchRecv, whose order has no flag but OrderJoin), so an engine may run
	// both on Stream.
	Order StreamOrder
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

// engine is the buffer's normal-mode engine and its peers' regions, for a call on a synced
// buffer within one NVLink domain.
func (b *Buffer) engine() (NormalEngine, []Region, error) {
	peers, err := b.Peers()
	if err != nil {
		return nil, nil, err
	}
	if b.topo.NumRDMARanks > 1 {
		return nil, nil, NotAvailablef("num_ranks = %d: normal mode across NVLink domains (internode) is not available yet; "+
			"use at most %d ranks%s", b.topo.NumRanks, NumMaxNVLPeers, b.topo.nodesHint())
	}
	e, err := b.NormalEngine()
	return e, peers, err
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
	topk := topkArg(ts, a.TopkIdx, false, -1)
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
	e, err := b.NormalEngine()
	if err != nil {
		return err
	}
	return wrap(e.Layout(op))
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
	if K > MaxTopK {
		return Argf("topk_weights: %d weights per row, expected at most %d", K, MaxTopK)
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
	return wrap(eng.Combine(peers, op))
}
