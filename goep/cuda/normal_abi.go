package cuda

// The host side of the kernels' parameter structs and records: the kernels (kernels/intranode.cu,
// layout.cu) static_assert the same sizes, and TestNormalParamLayouts checks these.

type kctx struct {
	Data, Ctl                                  [8]uint64
	Err, Seq, TimeoutNS, CounterBytes, HeadOff uint64
	Rank, NumChannels, RingSlots, Chunk        int32
}

type notifyParams struct {
	Ctx                                                         kctx
	InRank, PerRank, PerExpert, Topk, RankPrefix, ChannelPrefix uint64
	RecvChannelPrefix, RecvPerExpert, Result, ScratchOff        uint64
	BlockBytes                                                  uint64
	NumTokens, NumTopk, NumExperts, Alignment, NumWorst         int32
	Capacity                                                    int32
	LayoutRec, LayoutTag                                        uint64
}

type prologueParams struct {
	Ctx     kctx
	Op, Pad int32
}

type dispatchParams struct {
	Ctx                                                                  kctx
	X, XScales, Topk, Weights, InRank, RankPrefix, ChannelPrefix         uint64
	RecvX, RecvScales, RecvSrc, RecvTopk, RecvWeights, RecvChannelPrefix uint64
	SendHead                                                             uint64
	OffHidden, OffScales, OffSrc, OffTopk, OffWeights                    uint64
	NumTokens, NumExperts, NumOutRows, ScaleTokenStride                  int32
	ScaleStride, Pad                                                     int32
	GoSeq                                                                uint64
}

type combineParams struct {
	Ctx                                                            kctx
	X, Weights, SrcIdx, RankPrefix, ChannelPrefix, SendHead, Bias0 uint64
	Bias1, Out, OutWeights                                         uint64
	OffRow, OffSrc, OffWeights                                     uint64
	NumTokens, NumRows, Pad0, Pad1                                 int32
}

type layoutParams struct {
	Topk, PerRank, PerExpert, InRank, Result, Tag uint64
	NumTokens, NumTopk, NumExperts, NumRanks      int32
}

// opError is the kernels' error record (OpError in intranode.cu).
type opError struct {
	Code                    uint32
	Op, Rank, Channel, Peer int32
	What                    int32
	A, B, C                 int64
	WaitedNS, AbortWord     uint64
}

// notifyResult is notify's answer (NotifyResult in intranode.cu), followed by the per-expert
// counts.
type notifyResult struct {
	Tag                                  uint64
	NumRecv, Status, BadRank, PeerStatus int32
	D0, D1, D2                           int64
	Go, Pad                              int32
}

// Sizes the kernels static_assert or declare.
const (
	ctxBytes          = 184
	notifyParamsBytes = 312
	opErrorBytes      = 64
	notifyResultBytes = 56
)
