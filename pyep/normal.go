package pyep

import (
	"strings"
	"sync/atomic"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// Normal-mode exports. Everything crosses as plain integers, which gopy's wrapper converts for
// a few nanoseconds each (a go.Slice or a DLPack capsule would cost microseconds of Python):
//   - a caller's tensor as the eight integers of a goep.Desc: its data address, dtype index
//     (TorchNames), device code, dimensions, two sizes and two strides;
//   - a tensor the pyep layer allocated as its data address (0 for None);
//   - a Config as its five fields;
//   - the stream order as stream, event and flags (goep.StreamOrder).
// Every check is goep's; each export returns an int64 (gopy's string returns cost an
// allocation).

// lastEntry is CLOCK_MONOTONIC when the latest per-call export (normal or low-latency mode) was
// entered (LastEntryNs).
var lastEntry atomic.Int64

// entered stamps the entry of an export: with BufferLastLaunchNs, where a call's host time goes.
func entered() { lastEntry.Store(driver.MonotonicNS()) }

// LastEntryNs is CLOCK_MONOTONIC (Python's time.perf_counter clock), in nanoseconds, when the
// latest per-call export of this process (normal or low-latency mode) was entered: the Python part
// of a call ends there.
func LastEntryNs() int64 { return lastEntry.Load() }

// TorchNames is "dtypes;device types", each space-separated in the order of goep.DTypeNames and
// goep.DeviceTypes: the Python layer sends a dtype or device type as its index here.
func TorchNames() string {
	return strings.Join(goep.DTypeNames, " ") + ";" + strings.Join(goep.DeviceTypes, " ")
}

func desc(data uintptr, dtype, device, ndim int, s0, s1, t0, t1 int64) goep.Desc {
	return goep.Desc{Data: data, DType: dtype, Device: device, NDim: ndim, Size: [2]int64{s0, s1}, Stride: [2]int64{t0, t1}}
}

// bufferWithConfig finds buffer id and checks the call's Config.
func bufferWithConfig(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int) (*goep.Buffer, goep.Config, error) {
	b, err := lookup(id)
	if err != nil {
		return nil, goep.Config{}, err
	}
	cfg, err := goep.NewConfig(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	return b, cfg, err
}

// Layout is get_dispatch_layout of topk_idx into num_tokens_per_rank, num_tokens_per_expert and
// is_token_in_rank.
func Layout(id int64, numExperts int,
	tData uintptr, tType, tDev, tDim int, t0, t1, tS0, tS1 int64,
	perRank, perExpert, inRank, stream, event uintptr, flags int) (_ int64, err error) {
	entered()
	defer guard("Layout", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	return 0, b.Layout(&goep.LayoutArgs{TopkIdx: desc(tData, tType, tDev, tDim, t0, t1, tS0, tS1), NumExperts: numExperts,
		PerRank: perRank, PerExpert: perExpert, InRank: inRank,
		Order: goep.StreamOrder{Stream: stream, Event: event, Flags: flags}})
}

// dispatchArgs assembles the arguments that DispatchQueued and DispatchNotify share.
func dispatchArgs(cfg goep.Config, expertAlignment, numWorstTokens int, x, xScales, topkIdx, topkWeights,
	perRank, perExpert, inRank goep.Desc, rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead,
	counts, stream, event uintptr, flags int) *goep.DispatchArgs {
	return &goep.DispatchArgs{Config: cfg, ExpertAlignment: expertAlignment, NumWorstTokens: numWorstTokens,
		X: x, XScales: xScales, TopkIdx: topkIdx, TopkWeights: topkWeights, PerRank: perRank, PerExpert: perExpert,
		InRank: inRank, RankPrefix: rankPrefix, ChannelPrefix: channelPrefix, RecvChannelPrefix: recvChannelPrefix,
		RecvPerExpert: recvPerExpert, SendHead: sendHead, Counts: counts,
		Order: goep.StreamOrder{Stream: stream, Event: event, Flags: flags}}
}

// DispatchQueued is a dispatch's notify with its data phase queued behind it, into recv tensors
// of capacity rows, before the counts reach the host. It returns the rows this rank receives, or
// -(rows + 1) when some rank's rows exceeded its capacity and the data phase did not run:
// DispatchRecv into exact rows follows. counts is host memory for num_recv_tokens_per_expert
// (int32s).
func DispatchQueued(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv, expertAlignment, capacity int,
	xData uintptr, xType, xDev, xDim int, x0, x1, xS0, xS1 int64,
	sData uintptr, sType, sDev, sDim int, s0, s1, sS0, sS1 int64,
	iData uintptr, iType, iDev, iDim int, i0, i1, iS0, iS1 int64,
	wData uintptr, wType, wDev, wDim int, w0, w1, wS0, wS1 int64,
	prData uintptr, prType, prDev, prDim int, pr0, pr1, prS0, prS1 int64,
	peData uintptr, peType, peDev, peDim int, pe0, pe1, peS0, peS1 int64,
	irData uintptr, irType, irDev, irDim int, ir0, ir1, irS0, irS1 int64,
	rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead, counts uintptr,
	recvX, recvXScales, recvSrcIdx, recvTopkIdx, recvTopkWeights, stream, event uintptr, flags int) (_ int64, err error) {
	entered()
	defer guard("DispatchQueued", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	a := dispatchArgs(cfg, expertAlignment, 0,
		desc(xData, xType, xDev, xDim, x0, x1, xS0, xS1), desc(sData, sType, sDev, sDim, s0, s1, sS0, sS1),
		desc(iData, iType, iDev, iDim, i0, i1, iS0, iS1), desc(wData, wType, wDev, wDim, w0, w1, wS0, wS1),
		desc(prData, prType, prDev, prDim, pr0, pr1, prS0, prS1), desc(peData, peType, peDev, peDim, pe0, pe1, peS0, peS1),
		desc(irData, irType, irDev, irDim, ir0, ir1, irS0, irS1),
		rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead, counts, stream, event, flags)
	rows, ran, err := b.DispatchQueued(a, goep.RecvTensors{Rows: capacity, X: recvX, XScales: recvXScales,
		SrcIdx: recvSrcIdx, TopkIdx: recvTopkIdx, TopkWeights: recvTopkWeights})
	if err != nil || ran {
		return int64(rows), err
	}
	return -int64(rows + 1), nil
}

// DispatchNotify checks a dispatch and runs its count exchange; it returns the rows to allocate
// (the rows this rank receives, or num_worst_tokens) for DispatchRecv.
func DispatchNotify(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv, expertAlignment, numWorstTokens int,
	xData uintptr, xType, xDev, xDim int, x0, x1, xS0, xS1 int64,
	sData uintptr, sType, sDev, sDim int, s0, s1, sS0, sS1 int64,
	iData uintptr, iType, iDev, iDim int, i0, i1, iS0, iS1 int64,
	wData uintptr, wType, wDev, wDim int, w0, w1, wS0, wS1 int64,
	prData uintptr, prType, prDev, prDim int, pr0, pr1, prS0, prS1 int64,
	peData uintptr, peType, peDev, peDim int, pe0, pe1, peS0, peS1 int64,
	irData uintptr, irType, irDev, irDim int, ir0, ir1, irS0, irS1 int64,
	rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead, counts, stream, event uintptr,
	flags int) (_ int64, err error) {
	entered()
	defer guard("DispatchNotify", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	rows, err := b.DispatchNotify(dispatchArgs(cfg, expertAlignment, numWorstTokens,
		desc(xData, xType, xDev, xDim, x0, x1, xS0, xS1), desc(sData, sType, sDev, sDim, s0, s1, sS0, sS1),
		desc(iData, iType, iDev, iDim, i0, i1, iS0, iS1), desc(wData, wType, wDev, wDim, w0, w1, wS0, wS1),
		desc(prData, prType, prDev, prDim, pr0, pr1, prS0, prS1), desc(peData, peType, peDev, peDim, pe0, pe1, peS0, peS1),
		desc(irData, irType, irDev, irDim, ir0, ir1, irS0, irS1),
		rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead, counts, stream, event, flags))
	return int64(rows), err
}

// DispatchRecv is the data phase of the dispatch that DispatchNotify (or DispatchQueued, when
// its rows did not fit) began, into recv tensors of rows rows. Only flags' join applies: the
// notify ordered the start.
func DispatchRecv(id int64, rows int, recvX, recvXScales, recvSrcIdx, recvTopkIdx, recvTopkWeights, stream uintptr,
	flags int) (_ int64, err error) {
	entered()
	defer guard("DispatchRecv", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	return 0, b.DispatchRecv(goep.RecvTensors{Rows: rows, X: recvX, XScales: recvXScales, SrcIdx: recvSrcIdx,
		TopkIdx: recvTopkIdx, TopkWeights: recvTopkWeights}, goep.StreamOrder{Stream: stream, Flags: flags & goep.OrderJoin})
}

// DispatchCached dispatches x (and its scales) with the layout of a handle: its is_token_in_rank
// rows, channel_prefix_matrix columns and recv_src_idx rows, and its tensors.
func DispatchCached(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int,
	xData uintptr, xType, xDev, xDim int, x0, x1, xS0, xS1 int64,
	sData uintptr, sType, sDev, sDim int, s0, s1, sS0, sS1 int64,
	numTokens, numChannels, numRecv int, rankPrefix, channelPrefix, inRank, recvX, recvXScales, stream, event uintptr,
	flags int) (_ int64, err error) {
	entered()
	defer guard("DispatchCached", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	return 0, b.DispatchCached(&goep.CachedDispatchArgs{Config: cfg,
		X: desc(xData, xType, xDev, xDim, x0, x1, xS0, xS1), XScales: desc(sData, sType, sDev, sDim, s0, s1, sS0, sS1),
		NumTokens: numTokens, NumChannels: numChannels, NumRecv: numRecv, RankPrefix: rankPrefix, ChannelPrefix: channelPrefix,
		InRank: inRank, RecvX: recvX, RecvXScales: recvXScales, Order: goep.StreamOrder{Stream: stream, Event: event, Flags: flags}})
}

// Combine is combine of x (and topk_weights, the biases) with a handle: its send_head rows,
// recv_channel_prefix_matrix columns and recv_src_idx rows, and its tensors.
func Combine(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int,
	xData uintptr, xType, xDev, xDim int, x0, x1, xS0, xS1 int64,
	wData uintptr, wType, wDev, wDim int, w0, w1, wS0, wS1 int64,
	aData uintptr, aType, aDev, aDim int, a0, a1, aS0, aS1 int64,
	bData uintptr, bType, bDev, bDim int, b0, b1, bS0, bS1 int64,
	numTokens, numChannels, numRecv int, srcIdx, rankPrefix, channelPrefix, sendHead, combinedX, combinedWeights,
	stream, event uintptr, flags int) (_ int64, err error) {
	entered()
	defer guard("Combine", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	return 0, b.Combine(&goep.CombineArgs{Config: cfg,
		X: desc(xData, xType, xDev, xDim, x0, x1, xS0, xS1), TopkWeights: desc(wData, wType, wDev, wDim, w0, w1, wS0, wS1),
		Bias0: desc(aData, aType, aDev, aDim, a0, a1, aS0, aS1), Bias1: desc(bData, bType, bDev, bDim, b0, b1, bS0, bS1),
		NumTokens: numTokens, NumChannels: numChannels, NumRecv: numRecv, SrcIdx: srcIdx, RankPrefix: rankPrefix,
		ChannelPrefix: channelPrefix, SendHead: sendHead, CombinedX: combinedX, CombinedTopkWeights: combinedWeights,
		Order: goep.StreamOrder{Stream: stream, Event: event, Flags: flags}})
}

// PlanDispatch keeps, for the queued dispatch numbered num that follows a layout, all of its
// arguments but x, its scales, topk_weights and expert_alignment (goep's plans): its config, the
// layout's tensors, the handle's and recv tensors' addresses (capacity rows) and its stream. The
// dispatch is the usual call (no event, its order's wait and join).
func PlanDispatch(id, num int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv, capacity int,
	iData uintptr, iType, iDev, iDim int, i0, i1, iS0, iS1 int64,
	prData uintptr, prType, prDev, prDim int, pr0, pr1, prS0, prS1 int64,
	peData uintptr, peType, peDev, peDim int, pe0, pe1, peS0, peS1 int64,
	irData uintptr, irType, irDev, irDim int, ir0, ir1, irS0, irS1 int64,
	rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead, counts uintptr,
	recvX, recvXScales, recvSrcIdx, recvTopkIdx, recvTopkWeights, stream uintptr) (_ int64, err error) {
	defer guard("PlanDispatch", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	b.PlanDispatch(num, dispatchArgs(cfg, 0, 0, goep.Desc{}, goep.Desc{}, desc(iData, iType, iDev, iDim, i0, i1, iS0, iS1),
		goep.Desc{}, desc(prData, prType, prDev, prDim, pr0, pr1, prS0, prS1),
		desc(peData, peType, peDev, peDim, pe0, pe1, peS0, peS1), desc(irData, irType, irDev, irDim, ir0, ir1, irS0, irS1),
		rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, sendHead, counts, stream, 0, goep.OrderWait|goep.OrderJoin),
		goep.RecvTensors{Rows: capacity, X: recvX, XScales: recvXScales, SrcIdx: recvSrcIdx, TopkIdx: recvTopkIdx,
			TopkWeights: recvTopkWeights})
	return 0, nil
}

// DispatchPlanned is DispatchQueued of the plan numbered num (PlanDispatch) with x, its scales,
// topk_weights and expert_alignment; it returns what DispatchQueued returns.
func DispatchPlanned(id, num int64, expertAlignment int,
	xData uintptr, xType, xDev, xDim int, x0, x1, xS0, xS1 int64,
	sData uintptr, sType, sDev, sDim int, s0, s1, sS0, sS1 int64,
	wData uintptr, wType, wDev, wDim int, w0, w1, wS0, wS1 int64) (_ int64, err error) {
	entered()
	defer guard("DispatchPlanned", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	rows, ran, err := b.DispatchPlanned(num, desc(xData, xType, xDev, xDim, x0, x1, xS0, xS1),
		desc(sData, sType, sDev, sDim, s0, s1, sS0, sS1), desc(wData, wType, wDev, wDim, w0, w1, wS0, wS1), expertAlignment)
	if err != nil || ran {
		return int64(rows), err
	}
	return -int64(rows + 1), nil
}

// PlanCombine keeps, for the combine numbered num that follows a dispatch, all of its arguments but
// x and topk_weights: its config, the handle's tensors and sizes, the outputs' addresses and its
// stream. The combine is the usual call, without bias.
func PlanCombine(id, num int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int,
	numTokens, numChannels, numRecv int, srcIdx, rankPrefix, channelPrefix, sendHead, combinedX, combinedWeights,
	stream uintptr) (_ int64, err error) {
	defer guard("PlanCombine", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	none := goep.Desc{NDim: goep.NoneDim}
	b.PlanCombine(num, &goep.CombineArgs{Config: cfg, Bias0: none, Bias1: none,
		NumTokens: numTokens, NumChannels: numChannels, NumRecv: numRecv, SrcIdx: srcIdx, RankPrefix: rankPrefix,
		ChannelPrefix: channelPrefix, SendHead: sendHead, CombinedX: combinedX, CombinedTopkWeights: combinedWeights,
		Order: goep.StreamOrder{Stream: stream, Flags: goep.OrderWait | goep.OrderJoin}})
	return 0, nil
}

// CombinePlanned is Combine of the plan numbered num (PlanCombine) with x and topk_weights.
func CombinePlanned(id, num int64, xData uintptr, xType, xDev, xDim int, x0, x1, xS0, xS1 int64,
	wData uintptr, wType, wDev, wDim int, w0, w1, wS0, wS1 int64) (_ int64, err error) {
	entered()
	defer guard("CombinePlanned", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	return 0, b.CombinePlanned(num, desc(xData, xType, xDev, xDim, x0, x1, xS0, xS1),
		desc(wData, wType, wDev, wDim, w0, w1, wS0, wS1))
}
