//go:build cgo

package cudanormal

import (
	"fmt"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/dlpack"
)

// Dispatch implements goep.NormalEngine: it queues the kernel and returns.
func (e *engine) Dispatch(peers []goep.Region, a *goep.DispatchOp) error {
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
	f, off, shape, err := e.prepareDispatch(st, topo, a, limit, cuda.KernelDispatch)
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	// Without a notify before it (a cached dispatch) the kernel passes the call's barriers itself.
	p := &e.params.queued.dispatch
	e.fillDispatch(p, st, topo, peers, a, off)
	if !notified {
		p.barriers = 1
	}
	if err := e.launch(f, uint32(2*a.Config.NumChannels()), uint32(shape.Threads), unsafe.Pointer(p)); err != nil {
		return err
	}
	if !notified {
		st.seq += 2
	}
	return e.orderAfter(a.Order)
}

// prepareDispatch checks a dispatch whose rings must end by limit (the region's end, or the
// scratch of the notify before it) and finds its kernel and shape: kernel is cuda.KernelDispatch,
// or cuda.KernelNotifyDispatch for the queued dispatch (notify in the same launch).
func (e *engine) prepareDispatch(st *bufferState, topo goep.Topology, a *goep.DispatchOp, limit int64,
	kernel cuda.Kernel) (f driver.Function, off [5]int64, s Shape, err error) {
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	slots := a.Config.NumMaxNVLChunkedRecvTokens
	// goep checked the top-k and the experts; the row sizes are this engine's limits.
	switch {
	case a.HiddenBytes <= 0 || a.HiddenBytes > 1<<24 || a.ScalesBytes%4 != 0 || a.ScalesBytes > 1<<16:
		return f, off, s, goep.Argf("dispatch: %d bytes of hidden and %d of scales per token are not supported", a.HiddenBytes, a.ScalesBytes)
	}
	off, need := dispatchLayout(C, R, slots, a.HiddenBytes, a.ScalesBytes, a.NumTopk)
	if need > limit {
		what := "the rings"
		if limit < e.env.NumNVLBytes {
			what = "the rings (and the count exchange after them)"
		}
		return f, off, s, tooSmall("dispatch", me, e.env.NumNVLBytes, need+e.env.NumNVLBytes-limit, fmt.Sprintf("%s of %d ranks x %d channels x %d slots of %d bytes (hidden %d, scales %d, top-k %d) with %v",
			what, R, C, slots, a.HiddenBytes+a.ScalesBytes+4+12*a.NumTopk, a.HiddenBytes, a.ScalesBytes, a.NumTopk, configString(a.Config)))
	}
	op := OpDispatch
	switch {
	case a.ScalesBytes > 0:
		op = OpDispatchFP8
	case kernel == cuda.KernelDispatch:
		op = OpDispatchCounted
	}
	s = ShapeFor(op, R, e.opts.Threads, e.opts.Unroll)
	vec := vecBytes(a.HiddenBytes, ptr(a.X), ptr(a.RecvX))
	key := cuda.KernelKey{Kernel: kernel, Ranks: int32(R), A: int32(a.HiddenBytes), B: int32(a.ScalesBytes),
		C: int32(a.NumTopk), D: int32(vec), Threads: int32(s.Threads), Unroll: int32(s.Unroll)}
	f, err = e.b.Kernel(key, func() map[string]string {
		if kernel == cuda.KernelNotifyDispatch {
			return NotifyDispatchDefines(R, a.HiddenBytes, a.ScalesBytes, a.NumTopk, vec, s)
		}
		return DispatchDefines(R, a.HiddenBytes, a.ScalesBytes, a.NumTopk, vec, s)
	})
	return f, off, s, err
}

// fillDispatch fills p, the dispatch's launch parameters (without barriers of its own).
func (e *engine) fillDispatch(p *dispatchParams, st *bufferState, topo goep.Topology, peers []goep.Region, a *goep.DispatchOp, off [5]int64) {
	e.fillCtx(&p.ctx, st, topo, peers, a.Config)
	p.x, p.x_scales, p.topk, p.weights, p.in_rank = u64(ptr(a.X)), u64(ptr(a.XScales)), u64(ptr(a.TopkIdx)), u64(ptr(a.TopkWeights)), u64(ptr(a.InRank))
	p.rank_prefix, p.channel_prefix = u64(ptr(a.RankPrefix)), u64(ptr(a.ChannelPrefix))
	p.recv_x, p.recv_scales, p.recv_src = u64(ptr(a.RecvX)), u64(ptr(a.RecvXScales)), u64(ptr(a.RecvSrcIdx))
	p.recv_topk, p.recv_weights = u64(ptr(a.RecvTopkIdx)), u64(ptr(a.RecvTopkWeights))
	p.recv_channel_prefix, p.send_head = u64(ptr(a.RecvChannelPrefix)), u64(ptr(a.SendHead))
	p.off_hidden, p.off_scales, p.off_src, p.off_topk, p.off_weights = u64(off[0]), u64(off[1]), u64(off[2]), u64(off[3]), u64(off[4])
	p.num_tokens, p.num_experts, p.num_out_rows = i32(a.NumTokens), i32(a.NumExperts), i32(int(a.RecvX.Shape[0]))
	// Scales in words (goep checked that the strides fit); zero strides are dense rows.
	p.scale_token_stride, p.scale_stride = i32(a.ScalesTokenStride), i32(a.ScalesStride)
	if p.scale_token_stride == 0 && p.scale_stride == 0 {
		p.scale_token_stride, p.scale_stride = i32(a.ScalesBytes/4), 1
	}
	p.barriers = 0
}

// Combine implements goep.NormalEngine: it queues the kernel and returns.
func (e *engine) Combine(peers []goep.Region, a *goep.CombineOp) error {
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
	s := ShapeFor(OpCombine, R, e.opts.Threads, e.opts.Unroll)
	biases := combineBiases(ptr(a.Bias0), ptr(a.Bias1))
	key := cuda.KernelKey{Kernel: cuda.KernelCombine, Ranks: int32(R), A: int32(a.Hidden), B: dtype, C: int32(a.NumTopk),
		D: int32(vec), E: int32(biases), Threads: int32(s.Threads), Unroll: int32(s.Unroll)}
	f, err := e.b.Kernel(key, func() map[string]string {
		return CombineDefines(R, a.Hidden, int(dtype), a.NumTopk, biases, vec, s)
	})
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	// The kernel passes the call's barriers itself (intranode.cu's call_barriers).
	p := &e.params.combine
	e.fillCtx(&p.ctx, st, topo, peers, a.Config)
	p.x, p.weights, p.src_idx, p.rank_prefix = u64(ptr(a.X)), u64(ptr(a.TopkWeights)), u64(ptr(a.SrcIdx)), u64(ptr(a.RankPrefix))
	p.channel_prefix, p.send_head, p.bias0, p.bias1 = u64(ptr(a.ChannelPrefix)), u64(ptr(a.SendHead)), u64(ptr(a.Bias0)), u64(ptr(a.Bias1))
	p.out, p.out_weights = u64(ptr(a.CombinedX)), u64(ptr(a.CombinedTopkWeights))
	p.off_row, p.off_src, p.off_weights = u64(off[0]), u64(off[1]), u64(off[2])
	p.num_tokens, p.num_rows = i32(a.NumTokens), i32(int(a.X.Shape[0]))
	if err := e.launch(f, uint32(2*C), uint32(s.Threads), unsafe.Pointer(p)); err != nil {
		return err
	}
	st.seq += 2
	return e.orderAfter(a.Order)
}
