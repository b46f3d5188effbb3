package cuda

import (
	"fmt"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/dlpack"
)

// Dispatch implements goep.NormalEngine: it queues the kernels and returns.
func (e *normalEngine) Dispatch(peers []goep.Region, a *goep.DispatchOp) error {
	topo := e.env.Topo
	end, st, notified, err := e.enterBuffer()
	defer end()
	if err != nil {
		return err
	}
	// After a notify its scratch (at the end of every region) may still be read by a peer.
	limit := e.env.NumNVLBytes
	if notified {
		limit = st.scratchOff
	}
	f, off, err := e.prepareDispatch(st, topo, a, limit)
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	if !notified {
		if err := e.prologueFor(3, st, topo, peers, a.Config); err != nil {
			return err
		}
	}
	e.fillDispatch(st, topo, peers, a, off, 0)
	if err := e.launch(f, uint32(2*a.Config.NumChannels()), uint32(e.opts.Threads), unsafe.Pointer(&e.params.dispatch)); err != nil {
		return err
	}
	return e.orderAfter(a.Order)
}

// prepareDispatch checks a dispatch whose rings must end by limit (the region's end, or the
// scratch of the notify before it) and finds its kernel.
func (e *normalEngine) prepareDispatch(st *bufferState, topo goep.Topology, a *goep.DispatchOp, limit int64) (f Function, off [5]int64, err error) {
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	slots := a.Config.NumMaxNVLChunkedRecvTokens
	// goep checked the top-k and the experts; the row sizes are this engine's limits.
	switch {
	case a.HiddenBytes <= 0 || a.HiddenBytes > 1<<24 || a.ScalesBytes%4 != 0 || a.ScalesBytes > 1<<16:
		return f, off, goep.Argf("dispatch: %d bytes of hidden and %d of scales per token are not supported", a.HiddenBytes, a.ScalesBytes)
	}
	off, need := dispatchLayout(C, R, slots, a.HiddenBytes, a.ScalesBytes, a.NumTopk)
	if need > limit {
		what := "the rings"
		if limit < e.env.NumNVLBytes {
			what = "the rings (and the count exchange after them)"
		}
		return f, off, tooSmall("dispatch", me, e.env.NumNVLBytes, need+e.env.NumNVLBytes-limit, fmt.Sprintf("%s of %d ranks x %d channels x %d slots of %d bytes (hidden %d, scales %d, top-k %d) with %v",
			what, R, C, slots, a.HiddenBytes+a.ScalesBytes+4+12*a.NumTopk, a.HiddenBytes, a.ScalesBytes, a.NumTopk, configString(a.Config)))
	}
	threads := int32(e.opts.Threads)
	vec := vecBytes(a.HiddenBytes, ptr(a.X), ptr(a.RecvX))
	key := kernelKey{kind: kindDispatch, name: nameDispatch, ranks: int32(R), a: int32(a.HiddenBytes), b: int32(a.ScalesBytes),
		c: int32(a.NumTopk), d: int32(vec), threads: threads}
	f, err = e.b.kernels.function(e.b, key, "intranode.cu", func() map[string]string {
		return DispatchDefines(R, a.HiddenBytes, a.ScalesBytes, a.NumTopk, vec, int(threads))
	})
	return f, off, err
}

// fillDispatch fills the dispatch's launch parameters; goSeq is the notify that must let a
// speculative dispatch run (0: it runs).
func (e *normalEngine) fillDispatch(st *bufferState, topo goep.Topology, peers []goep.Region, a *goep.DispatchOp, off [5]int64, goSeq uint64) {
	p := &e.params.dispatch
	e.fillCtx(&p.Ctx, st, topo, peers, a.Config)
	p.X, p.XScales, p.Topk, p.Weights, p.InRank = ptr(a.X), ptr(a.XScales), ptr(a.TopkIdx), ptr(a.TopkWeights), ptr(a.InRank)
	p.RankPrefix, p.ChannelPrefix = ptr(a.RankPrefix), ptr(a.ChannelPrefix)
	p.RecvX, p.RecvScales, p.RecvSrc = ptr(a.RecvX), ptr(a.RecvXScales), ptr(a.RecvSrcIdx)
	p.RecvTopk, p.RecvWeights = ptr(a.RecvTopkIdx), ptr(a.RecvTopkWeights)
	p.RecvChannelPrefix, p.SendHead = ptr(a.RecvChannelPrefix), ptr(a.SendHead)
	p.OffHidden, p.OffScales, p.OffSrc, p.OffTopk, p.OffWeights = uint64(off[0]), uint64(off[1]), uint64(off[2]), uint64(off[3]), uint64(off[4])
	p.NumTokens, p.NumExperts, p.NumOutRows = int32(a.NumTokens), int32(a.NumExperts), int32(a.RecvX.Shape[0])
	// Scales in words (goep checked that the strides fit); zero strides are dense rows.
	p.ScaleTokenStride, p.ScaleStride = int32(a.ScalesTokenStride), int32(a.ScalesStride)
	if p.ScaleTokenStride == 0 && p.ScaleStride == 0 {
		p.ScaleTokenStride, p.ScaleStride = int32(a.ScalesBytes/4), 1
	}
	p.GoSeq = goSeq
}

// Combine implements goep.NormalEngine: it queues the kernels and returns.
func (e *normalEngine) Combine(peers []goep.Region, a *goep.CombineOp) error {
	topo := e.env.Topo
	end, st, _, err := e.enterBuffer()
	defer end()
	if err != nil {
		return err
	}
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	slots := a.Config.NumMaxNVLChunkedRecvTokens
	// goep checked x's dtype (bfloat16, float16 or float32), the top-k and the handle's rows.
	dtype, es := int32(1), int32(a.X.DType.Size())
	switch a.X.DType {
	case dlpack.F16:
		dtype = 2
	case dlpack.F32:
		dtype = 3
	}
	rowBytes := a.Hidden * int(es)
	if rowBytes > 1<<24 {
		return goep.Argf("combine: hidden = %d is not supported", a.Hidden)
	}
	off, need := combineLayout(C, R, slots, rowBytes, a.NumTopk)
	if need > e.env.NumNVLBytes {
		return tooSmall("combine", me, e.env.NumNVLBytes, need, fmt.Sprintf("the rings of %d ranks x %d channels x %d slots of %d bytes (%d x %v, top-k %d) with %v",
			R, C, slots, rowBytes+4+4*a.NumTopk, a.Hidden, a.X.DType, a.NumTopk, configString(a.Config)))
	}
	vec := max(vecBytes(rowBytes, ptr(a.X), ptr(a.Bias0), ptr(a.Bias1), ptr(a.CombinedX)), int(es))
	if rowBytes%vec != 0 || ptr(a.X)%uint64(es) != 0 || ptr(a.CombinedX)%uint64(es) != 0 ||
		ptr(a.Bias0)%uint64(es) != 0 || ptr(a.Bias1)%uint64(es) != 0 {
		return goep.Argf("combine: x, bias and combined_x must be aligned to their %d-byte elements", es)
	}
	threads := int32(e.opts.Threads)
	key := kernelKey{kind: kindCombine, name: nameCombine, ranks: int32(R), a: int32(a.Hidden), b: dtype, c: int32(a.NumTopk),
		d: int32(vec), threads: threads}
	f, err := e.b.kernels.function(e.b, key, "intranode.cu", func() map[string]string {
		return CombineDefines(R, a.Hidden, int(dtype), a.NumTopk, vec, int(threads))
	})
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	if err := e.prologueFor(4, st, topo, peers, a.Config); err != nil {
		return err
	}
	p := &e.params.combine
	e.fillCtx(&p.Ctx, st, topo, peers, a.Config)
	p.X, p.Weights, p.SrcIdx, p.RankPrefix = ptr(a.X), ptr(a.TopkWeights), ptr(a.SrcIdx), ptr(a.RankPrefix)
	p.ChannelPrefix, p.SendHead, p.Bias0, p.Bias1 = ptr(a.ChannelPrefix), ptr(a.SendHead), ptr(a.Bias0), ptr(a.Bias1)
	p.Out, p.OutWeights = ptr(a.CombinedX), ptr(a.CombinedTopkWeights)
	p.OffRow, p.OffSrc, p.OffWeights = uint64(off[0]), uint64(off[1]), uint64(off[2])
	p.NumTokens, p.NumRows = int32(a.NumTokens), int32(a.X.Shape[0])
	if err := e.launch(f, uint32(2*C), uint32(threads), unsafe.Pointer(p)); err != nil {
		return err
	}
	return e.orderAfter(a.Order)
}
