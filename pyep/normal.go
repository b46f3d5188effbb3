package pyep

import "github.com/pyep/pyep/goep"

// Normal-mode exports. The caller's tensors are DLPack addresses and the tensors the pyep layer
// allocated are data addresses (0 for None; see goep.Tensors); configs are their five fields.
// stream and order are the call's stream order (see ordered).

// bufferWithConfig finds buffer id and checks the call's Config.
func bufferWithConfig(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int) (*goep.Buffer, goep.Config, error) {
	b, err := lookup(id)
	if err != nil {
		return nil, goep.Config{}, err
	}
	cfg, err := goep.NewConfig(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	return b, cfg, err
}

// Layout is get_dispatch_layout.
func Layout(id int64, topkIdx uintptr, numExperts int, perRank, perExpert, inRank, stream uintptr, order int) (err error) {
	defer guard("Layout", &err)
	b, err := lookup(id)
	if err != nil {
		return err
	}
	return ordered(b, stream, order, func() error { return b.Layout(topkIdx, numExperts, perRank, perExpert, inRank) })
}

// DispatchNotify is the count exchange of a non-cached dispatch; it returns the rows this rank
// receives. topkIdx (0 for None) is the dispatch's topk_idx, checked there on the cuda backend.
func DispatchNotify(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int,
	numExperts, expertAlignment, numWorstTokens int,
	perRank, perExpert, inRank, rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert, topkIdx, stream uintptr,
	order int) (n int, err error) {
	defer guard("DispatchNotify", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	err = ordered(b, stream, order, func() error {
		n, err = b.Notify(goep.NotifyArgs{Config: cfg, NumExperts: numExperts, ExpertAlignment: expertAlignment,
			NumWorstTokens: numWorstTokens, NumTokensPerRank: perRank, NumTokensPerExpert: perExpert,
			IsTokenInRank: inRank, RankPrefixMatrix: rankPrefix, ChannelPrefixMatrix: channelPrefix,
			RecvChannelPrefixMatrix: recvChannelPrefix, NumRecvTokensPerExpert: recvPerExpert, TopkIdx: topkIdx})
		return err
	})
	return n, err
}

// DispatchQueued is DispatchNotify with the data phase queued behind it, into recv tensors of
// capacity rows, before the counts reach the host. It returns the rows this rank receives, or
// -(rows + 1) when some rank's rows exceeded its capacity and the data phase did not run: a
// Dispatch into exact rows must follow.
func DispatchQueued(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int,
	numExperts, expertAlignment, capacity int,
	perRank, perExpert, inRank, rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert uintptr,
	x, xScales, topkIdx, topkWeights, recvX, recvXScales, recvSrcIdx, recvTopkIdx, recvTopkWeights, sendHead,
	stream uintptr, order int) (n int, err error) {
	defer guard("DispatchQueued", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	var rows int
	var ran bool
	err = ordered(b, stream, order, func() error {
		rows, ran, err = b.NotifyDispatch(capacity,
			goep.NotifyArgs{Config: cfg, NumExperts: numExperts, ExpertAlignment: expertAlignment,
				NumTokensPerRank: perRank, NumTokensPerExpert: perExpert, IsTokenInRank: inRank, RankPrefixMatrix: rankPrefix,
				ChannelPrefixMatrix: channelPrefix, RecvChannelPrefixMatrix: recvChannelPrefix,
				NumRecvTokensPerExpert: recvPerExpert, TopkIdx: topkIdx},
			goep.DispatchArgs{Config: cfg, NumExperts: numExperts, NumRecv: capacity, X: x, XScales: xScales, TopkIdx: topkIdx,
				TopkWeights: topkWeights, IsTokenInRank: inRank, RankPrefixMatrix: rankPrefix, ChannelPrefixMatrix: channelPrefix,
				RecvX: recvX, RecvXScales: recvXScales, RecvSrcIdx: recvSrcIdx, RecvTopkIdx: recvTopkIdx,
				RecvTopkWeights: recvTopkWeights, SendHead: sendHead})
		return err
	})
	if err != nil || ran {
		return rows, err
	}
	return -(rows + 1), nil
}

// Dispatch is the data phase of dispatch (cached when topkIdx is 0), into recv tensors of
// numRecv rows.
func Dispatch(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int, numExperts, numWorstTokens, numRecv int,
	x, xScales, topkIdx, topkWeights, inRank, rankPrefix, channelPrefix,
	recvX, recvXScales, recvSrcIdx, recvTopkIdx, recvTopkWeights, recvChannelPrefix, sendHead, stream uintptr, order int) (err error) {
	defer guard("Dispatch", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return err
	}
	return ordered(b, stream, order, func() error {
		return b.Dispatch(goep.DispatchArgs{Config: cfg, NumExperts: numExperts, NumWorstTokens: numWorstTokens, NumRecv: numRecv,
			X: x, XScales: xScales, TopkIdx: topkIdx, TopkWeights: topkWeights, IsTokenInRank: inRank,
			RankPrefixMatrix: rankPrefix, ChannelPrefixMatrix: channelPrefix, RecvX: recvX, RecvXScales: recvXScales,
			RecvSrcIdx: recvSrcIdx, RecvTopkIdx: recvTopkIdx, RecvTopkWeights: recvTopkWeights,
			RecvChannelPrefixMatrix: recvChannelPrefix, SendHead: sendHead})
	})
}

// Combine is combine, back to numTokens tokens from the dispatch's numRecv rows.
func Combine(id int64, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int, numTokens, numRecv int,
	x, topkWeights, srcIdx, rankPrefix, channelPrefix, sendHead, bias0, bias1, combinedX, combinedWeights, stream uintptr,
	order int) (err error) {
	defer guard("Combine", &err)
	b, cfg, err := bufferWithConfig(id, numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return err
	}
	return ordered(b, stream, order, func() error {
		return b.Combine(goep.CombineArgs{Config: cfg, NumTokens: numTokens, NumRecv: numRecv, X: x, TopkWeights: topkWeights,
			SrcIdx: srcIdx, RankPrefixMatrix: rankPrefix, ChannelPrefixMatrix: channelPrefix, SendHead: sendHead,
			Bias0: bias0, Bias1: bias1, CombinedX: combinedX, CombinedTopkWeights: combinedWeights})
	})
}
