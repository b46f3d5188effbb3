package cpu

import (
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// normalEngine is a buffer's normal mode on host memory: goep/normal's algorithms over the
// peers' mapped segments, synchronous (a call has finished when it returns, so the stream
// order has nothing to do). It holds no state between calls: every rank's protocol state is in
// the control regions.
type normalEngine struct {
	env goep.EngineEnv
}

var _ goep.NormalEngines = Backend{}

// NewNormalEngine implements goep.NormalEngines.
func (Backend) NewNormalEngine(env goep.EngineEnv) (goep.NormalEngine, error) {
	return &normalEngine{env: env}, nil
}

// Close implements goep.Engine: nothing to release.
func (*normalEngine) Close() error { return nil }

// domain is goep/normal's view of the mapped regions for one call.
func (e *normalEngine) domain(peers []goep.Region) *normal.Domain {
	d := &normal.Domain{Rank: e.env.Topo.NVLRank, NumRanks: e.env.Topo.NumNVLRanks, NumBytes: e.env.NumNVLBytes,
		Timeout: goep.OpTimeout(), Buffers: make([]unsafe.Pointer, len(peers)), Controls: make([]unsafe.Pointer, len(peers))}
	for i, p := range peers {
		d.Buffers[i], d.Controls[i] = p.Data(), p.Control()
	}
	return d
}

// config is the intranode part of a Config.
func config(c goep.Config) normal.Config {
	return normal.Config{NumSMs: c.NumSMs, NumMaxNVLChunkedSendTokens: c.NumMaxNVLChunkedSendTokens,
		NumMaxNVLChunkedRecvTokens: c.NumMaxNVLChunkedRecvTokens}
}

// Layout implements goep.NormalEngine.
func (e *normalEngine) Layout(a *goep.LayoutOp) error {
	return normal.Layout(goep.Int64s(a.TopkIdx), int(a.TopkIdx.Shape[0]), int(a.TopkIdx.Shape[1]), a.NumExperts, a.NumRanks,
		goep.Int32s(a.PerRank), goep.Int32s(a.PerExpert), goep.Bools(a.InRank))
}

// Notify implements goep.NormalEngine.
func (e *normalEngine) Notify(peers []goep.Region, n *goep.NotifyOp) (int, error) {
	res, err := normal.Notify(e.domain(peers), &normal.NotifyArgs{
		Config: config(n.Config), NumTokens: n.NumTokens, NumExperts: n.NumExperts,
		ExpertAlignment: n.ExpertAlignment, NumWorstTokens: n.NumWorstTokens,
		NumTokensPerRank: goep.Int32s(n.PerRank), NumTokensPerExpert: goep.Int32s(n.PerExpert), IsTokenInRank: goep.Bools(n.InRank),
		RankPrefixMatrix: goep.Int32s(n.RankPrefix), ChannelPrefixMatrix: goep.Int32s(n.ChannelPrefix),
		RecvChannelPrefixMatrix: goep.Int32s(n.RecvChannelPrefix), NumRecvTokensPerExpert: goep.Int32s(n.RecvPerExpert),
	})
	return res.NumRecvTokens, err
}

// Dispatch implements goep.NormalEngine.
func (e *normalEngine) Dispatch(peers []goep.Region, op *goep.DispatchOp) error {
	return normal.Dispatch(e.domain(peers), &normal.DispatchArgs{
		Config: config(op.Config), NumTokens: op.NumTokens, HiddenBytes: op.HiddenBytes, ScalesBytes: op.ScalesBytes,
		ScalesTokenStride: op.ScalesTokenStride, ScalesStride: op.ScalesStride, NumTopk: op.NumTopk, NumExperts: op.NumExperts,
		X: goep.Bytes(op.X), XScales: goep.Bytes(op.XScales), TopkIdx: goep.Int64s(op.TopkIdx), TopkWeights: goep.Float32s(op.TopkWeights),
		IsTokenInRank: goep.Bools(op.InRank), RankPrefixMatrix: goep.Int32s(op.RankPrefix), ChannelPrefixMatrix: goep.Int32s(op.ChannelPrefix),
		NumWorstTokens: op.NumWorstTokens, RecvX: goep.Bytes(op.RecvX), RecvXScales: goep.Bytes(op.RecvXScales),
		RecvSrcIdx: goep.Int32s(op.RecvSrcIdx), RecvTopkIdx: goep.Int64s(op.RecvTopkIdx), RecvTopkWeights: goep.Float32s(op.RecvTopkWeights),
		RecvChannelPrefixMatrix: goep.Int32s(op.RecvChannelPrefix), SendHead: goep.Int32s(op.SendHead),
	})
}

// Combine implements goep.NormalEngine.
func (e *normalEngine) Combine(peers []goep.Region, op *goep.CombineOp) error {
	return normal.Combine(e.domain(peers), &normal.CombineArgs{
		Config: config(op.Config), DType: combineDType(op.X.DType), Hidden: op.Hidden, NumTopk: op.NumTopk, NumTokens: op.NumTokens,
		X: goep.Bytes(op.X), TopkWeights: goep.Float32s(op.TopkWeights), SrcIdx: goep.Int32s(op.SrcIdx),
		RankPrefixMatrix: goep.Int32s(op.RankPrefix), ChannelPrefixMatrix: goep.Int32s(op.ChannelPrefix), SendHead: goep.Int32s(op.SendHead),
		Bias0: goep.Bytes(op.Bias0), Bias1: goep.Bytes(op.Bias1), CombinedX: goep.Bytes(op.CombinedX),
		CombinedTopkWeights: goep.Float32s(op.CombinedTopkWeights),
	})
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
