package goep

import (
	"errors"
	"os"
	"strconv"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// The normal-mode operations of a Buffer: layout, notify (the count exchange of a dispatch),
// dispatch (also cached) and combine. Every tensor arrives as a DLPack address; outputs are
// allocated by the caller. On the cpu backend the data moves through the peers' shared regions
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
	// Rows that move as opaque bytes: any element type.
	anyRow = []dlpack.DType{dlpack.BF16, dlpack.F16, dlpack.F32, dlpack.FP8E4M3, {Code: dlpack.UInt, Bits: 8}, {Code: dlpack.Int, Bits: 8}}
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

// domain is this rank's view of the shared regions for one call.
func (b *Buffer) domain() (*normal.Domain, error) {
	peers, err := b.Peers()
	if err != nil {
		return nil, err
	}
	if b.backend.DeviceID() >= 0 {
		return nil, errors.New("normal mode on the cuda backend is not available yet")
	}
	if b.topo.NumRDMARanks > 1 {
		return nil, Argf("num_ranks = %d: normal mode across NVLink domains (internode) is not available yet; use at most %d ranks", b.topo.NumRanks, NumMaxNVLPeers)
	}
	d := &normal.Domain{Rank: b.topo.NVLRank, NumRanks: b.topo.NumNVLRanks, NumBytes: b.params.NumNVLBytes, Timeout: opTimeout,
		Buffers: make([]unsafe.Pointer, len(peers)), Controls: make([]unsafe.Pointer, len(peers))}
	for i, p := range peers {
		d.Buffers[i], d.Controls[i] = p.Data(), p.Control()
	}
	return d, nil
}

func (b *Buffer) tensors() *Tensors {
	if b.backend.DeviceID() >= 0 {
		return &Tensors{DeviceType: dlpack.CUDA}
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

// Layout counts, for topk_idx [T, K], the tokens for each rank and expert and which ranks
// each token goes to.
func (b *Buffer) Layout(topkIdx uintptr, numExperts int, perRank, perExpert, inRank uintptr) error {
	R := int64(b.topo.NumRanks)
	ts := b.tensors()
	topk := ts.Get("topk_idx", topkIdx, false, i64, -1, -1)
	pr := ts.Get("num_tokens_per_rank", perRank, false, i32, R)
	pe := ts.Get("num_tokens_per_expert", perExpert, false, i32, int64(numExperts))
	T := int64(0)
	if ts.Err == nil {
		T = topk.Shape[0]
	}
	ir := ts.Get("is_token_in_rank", inRank, false, bool_, T, R)
	if ts.Err != nil {
		return ts.Err
	}
	if numExperts <= 0 || numExperts%int(R) != 0 {
		return Argf("num_experts = %d: expected a positive multiple of num_ranks = %d", numExperts, R)
	}
	if b.backend.DeviceID() >= 0 {
		return errors.New("get_dispatch_layout on the cuda backend is not available yet")
	}
	return wrap(normal.Layout(Int64s(topk), int(T), int(topk.Shape[1]), numExperts, int(R), Int32s(pr), Int32s(pe), Bools(ir)))
}

// NotifyArgs are the tensors of a dispatch's count exchange.
type NotifyArgs struct {
	Config                                              Config
	NumExperts, ExpertAlignment, NumWorstTokens         int
	NumTokensPerRank, NumTokensPerExpert, IsTokenInRank uintptr
	RankPrefixMatrix, ChannelPrefixMatrix               uintptr
	RecvChannelPrefixMatrix, NumRecvTokensPerExpert     uintptr
}

// Notify exchanges a dispatch's counts with every peer and returns how many rows this rank
// receives.
func (b *Buffer) Notify(a NotifyArgs) (int, error) {
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	if a.NumExperts <= 0 || a.NumExperts%int(R) != 0 {
		return 0, Argf("num_tokens_per_expert: %d experts, expected a positive multiple of num_ranks = %d", a.NumExperts, R)
	}
	ts := b.tensors()
	ir := ts.Get("is_token_in_rank", a.IsTokenInRank, false, bool_, -1, R)
	pr := ts.Get("num_tokens_per_rank", a.NumTokensPerRank, false, i32, R)
	pe := ts.Get("num_tokens_per_expert", a.NumTokensPerExpert, false, i32, int64(a.NumExperts))
	rpm := ts.Get("rank_prefix_matrix", a.RankPrefixMatrix, false, i32, R, R)
	cpm := ts.Get("channel_prefix_matrix", a.ChannelPrefixMatrix, false, i32, R, C)
	rcpm := ts.Get("recv_channel_prefix_matrix", a.RecvChannelPrefixMatrix, false, i32, R, C)
	rpe := ts.Get("num_recv_tokens_per_expert", a.NumRecvTokensPerExpert, false, i32, int64(a.NumExperts)/R)
	if ts.Err != nil {
		return 0, ts.Err
	}
	d, err := b.domain()
	if err != nil {
		return 0, err
	}
	res, err := normal.Notify(d, &normal.NotifyArgs{
		Config: a.Config.normal(), NumTokens: int(ir.Shape[0]), NumExperts: a.NumExperts,
		ExpertAlignment: a.ExpertAlignment, NumWorstTokens: a.NumWorstTokens,
		NumTokensPerRank: Int32s(pr), NumTokensPerExpert: Int32s(pe), IsTokenInRank: Bools(ir),
		RankPrefixMatrix: Int32s(rpm), ChannelPrefixMatrix: Int32s(cpm),
		RecvChannelPrefixMatrix: Int32s(rcpm), NumRecvTokensPerExpert: Int32s(rpe),
	})
	return res.NumRecvTokens, wrap(err)
}

// DispatchArgs are the tensors of a dispatch; a cached dispatch has no top-k tensors.
type DispatchArgs struct {
	Config                                             Config
	NumExperts, NumWorstTokens                         int
	X, XScales, TopkIdx, TopkWeights, IsTokenInRank    uintptr
	RankPrefixMatrix, ChannelPrefixMatrix              uintptr
	RecvX, RecvXScales, RecvSrcIdx, RecvTopkIdx        uintptr
	RecvTopkWeights, RecvChannelPrefixMatrix, SendHead uintptr
}

// Dispatch moves every token to the ranks of its experts.
func (b *Buffer) Dispatch(a DispatchArgs) error {
	R, C := int64(b.topo.NumRanks), int64(a.Config.NumChannels())
	ts := b.tensors()
	x := ts.Get("x", a.X, false, anyRow, -1, -1)
	T, N, K := int64(0), int64(-1), int64(0)
	if ts.Err == nil {
		T = x.Shape[0]
	}
	scales := ts.Get("x_scales", a.XScales, true, f32, T, -1)
	topk := ts.Get("topk_idx", a.TopkIdx, true, i64, T, -1)
	if topk.Valid {
		K = topk.Shape[1]
	}
	weights := ts.Get("topk_weights", a.TopkWeights, !topk.Valid, f32, T, K)
	ir := ts.Get("is_token_in_rank", a.IsTokenInRank, false, bool_, T, R)
	rpm := ts.Get("rank_prefix_matrix", a.RankPrefixMatrix, false, i32, R, R)
	cpm := ts.Get("channel_prefix_matrix", a.ChannelPrefixMatrix, true, i32, R, C)
	var recvX dlpack.Tensor
	if ts.Err == nil {
		recvX = ts.Get("recv_x", a.RecvX, false, []dlpack.DType{x.DType}, -1, x.Shape[1])
	}
	if ts.Err == nil {
		N = recvX.Shape[0]
	}
	var recvScales dlpack.Tensor
	if scales.Valid {
		recvScales = ts.Get("recv_x_scales", a.RecvXScales, false, f32, N, scales.Shape[1])
	}
	srcIdx := ts.Get("recv_src_idx", a.RecvSrcIdx, true, i32, N)
	var recvTopk, recvWeights dlpack.Tensor
	if K > 0 {
		recvTopk = ts.Get("recv_topk_idx", a.RecvTopkIdx, false, i64, N, K)
		recvWeights = ts.Get("recv_topk_weights", a.RecvTopkWeights, false, f32, N, K)
	}
	rcpm := ts.Get("recv_channel_prefix_matrix", a.RecvChannelPrefixMatrix, true, i32, R, C)
	sendHead := ts.Get("send_head", a.SendHead, true, i32, T, R)
	if ts.Err != nil {
		return ts.Err
	}
	d, err := b.domain()
	if err != nil {
		return err
	}
	return wrap(normal.Dispatch(d, &normal.DispatchArgs{
		Config: a.Config.normal(), NumTokens: int(T), HiddenBytes: RowBytes(x), ScalesBytes: RowBytes(scales),
		NumTopk: int(K), NumExperts: a.NumExperts,
		X: Bytes(x), XScales: Bytes(scales), TopkIdx: Int64s(topk), TopkWeights: Float32s(weights), IsTokenInRank: Bools(ir),
		RankPrefixMatrix: Int32s(rpm), ChannelPrefixMatrix: Int32s(cpm), NumWorstTokens: a.NumWorstTokens,
		RecvX: Bytes(recvX), RecvXScales: Bytes(recvScales), RecvSrcIdx: Int32s(srcIdx),
		RecvTopkIdx: Int64s(recvTopk), RecvTopkWeights: Float32s(recvWeights),
		RecvChannelPrefixMatrix: Int32s(rcpm), SendHead: Int32s(sendHead),
	}))
}

// CombineArgs are the tensors of a combine.
type CombineArgs struct {
	Config                                          Config
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
	srcIdx := ts.Get("src_idx", a.SrcIdx, false, i32, -1)
	rpm := ts.Get("rank_prefix_matrix", a.RankPrefixMatrix, false, i32, R, R)
	rcpm := ts.Get("channel_prefix_matrix", a.ChannelPrefixMatrix, false, i32, R, C)
	sendHead := ts.Get("send_head", a.SendHead, false, i32, -1, R)
	T := int64(0)
	if ts.Err == nil {
		T = sendHead.Shape[0]
	}
	same := []dlpack.DType{x.DType}
	bias0 := ts.Get("bias[0]", a.Bias0, true, same, T, H)
	bias1 := ts.Get("bias[1]", a.Bias1, true, same, T, H)
	out := ts.Get("combined_x", a.CombinedX, false, same, T, H)
	outWeights := ts.Get("combined_topk_weights", a.CombinedTopkWeights, K == 0, f32, T, K)
	if ts.Err != nil {
		return ts.Err
	}
	d, err := b.domain()
	if err != nil {
		return err
	}
	return wrap(normal.Combine(d, &normal.CombineArgs{
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
