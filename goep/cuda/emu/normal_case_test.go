//go:build cgo

package emu_test

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// runCase runs one case through every normal-mode call of the emulated engine (notify, dispatch,
// cached dispatch, the queued dispatch, combine) on every rank and compares each output, bit for
// bit, with goep/normal's over the same inputs. It returns more rounds of the cached dispatch and
// the combine on the handle of its dispatch.
func runCase(t *testing.T, envs []*rankEnv, c rcase) *caseRounds {
	R, K, E := c.R, c.K, c.E
	C := c.cfg.NumChannels()
	topo := make([]goep.Topology, R)
	peers := make([][]goep.Region, R)
	for r, e := range envs {
		topo[r] = e.buf.Topology()
		var err error
		peers[r], err = e.buf.Peers()
		require.NoError(t, err)
	}
	type rankData struct {
		topk                                           []int64
		w, scales                                      []float32
		x                                              []byte
		T                                              int
		dTopk, dW, dX, dSc                             dev
		perRank, perExpert, inRank                     dev
		rankPrefix, channelPrefix, recvChannelPrefix   dev
		recvPerExpert                                  dev
		n                                              int
		recvX, recvSc, recvSrc, recvTopk, recvW, sendH dev
	}
	rd := make([]*rankData, R)
	for r, e := range envs {
		d := &rankData{}
		d.topk, d.w, d.x, d.scales = c.inputs(r)
		d.T = c.tokens(r)
		T := int64(d.T)
		d.dTopk = e.upload(t, dlpack.I64, bytesOf(d.topk), T, int64(K))
		d.dW = e.upload(t, dlpack.F32, bytesOf(d.w), T, int64(K))
		d.dX = e.upload(t, c.dtype, d.x, T, int64(c.hidden))
		if c.scales > 0 {
			d.dSc = e.upload(t, dlpack.F32, bytesOf(d.scales), T, int64(c.scales))
			if c.colScales {
				d.dSc = e.columnMajor(t, d.scales, d.T, c.scales, c.scalePad)
			}
		}
		d.perRank = e.alloc(t, dlpack.I32, int64(R))
		d.perExpert = e.alloc(t, dlpack.I32, int64(E))
		d.inRank = e.alloc(t, dlpack.BoolT, T, int64(R))
		rd[r] = d
	}

	// Layout.
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		return envs[r].normal().Layout(&goep.LayoutOp{NumExperts: E, NumRanks: R, TopkIdx: d.dTopk.t, PerRank: d.perRank.t,
			PerExpert: d.perExpert.t, InRank: d.inRank.t})
	}))
	for r, d := range rd {
		perRank, perExpert, inRank := make([]int32, R), make([]int32, E), make([]bool, d.T*R)
		require.NoError(t, normal.Layout(d.topk, d.T, K, E, R, perRank, perExpert, inRank))
		require.Equal(t, perRank, i32s(d.perRank.b), "rank %d per_rank", r)
		require.Equal(t, perExpert, i32s(d.perExpert.b), "rank %d per_expert", r)
		require.Equal(t, inRank, bools(d.inRank.b), "rank %d in_rank", r)
	}

	// Reference: notify, dispatch, cached dispatch, combine.
	refBytes, err := c.cfg.NVLBufferSizeHint(c.hidden*c.dtype.Size()+c.scales*4, R)
	require.NoError(t, err)
	doms := refDomain(R, max(64<<20, refBytes))
	type refOut struct {
		rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert []int32
		n                                                           int
		recvX                                                       []byte
		recvSc                                                      []byte
		recvSrc                                                     []int32
		recvTopk                                                    []int64
		recvW                                                       []float32
		sendHead                                                    []int32
		biases                                                      [][]byte
	}
	ref := make([]*refOut, R)
	ncfg := normal.Config{NumSMs: c.cfg.NumSMs, NumMaxNVLChunkedSendTokens: c.cfg.NumMaxNVLChunkedSendTokens,
		NumMaxNVLChunkedRecvTokens: c.cfg.NumMaxNVLChunkedRecvTokens}
	for r := range ref {
		ref[r] = &refOut{rankPrefix: make([]int32, R*R), channelPrefix: make([]int32, R*C), recvChannelPrefix: make([]int32, R*C),
			recvPerExpert: make([]int32, E/R)}
	}
	noErrors(t, each(R, func(r int) error {
		d, o := rd[r], ref[r]
		res, err := normal.Notify(doms[r], &normal.NotifyArgs{Config: ncfg, NumTokens: d.T, NumExperts: E, ExpertAlignment: c.align,
			NumTokensPerRank: i32s(d.perRank.b), NumTokensPerExpert: i32s(d.perExpert.b), IsTokenInRank: bools(d.inRank.b),
			RankPrefixMatrix: o.rankPrefix, ChannelPrefixMatrix: o.channelPrefix, RecvChannelPrefixMatrix: o.recvChannelPrefix,
			NumRecvTokensPerExpert: o.recvPerExpert})
		o.n = res.NumRecvTokens
		return err
	}))
	worst := 0
	if c.worst > 0 {
		for _, o := range ref {
			worst = max(worst, o.n)
		}
		worst += c.worst
	}
	es := c.dtype.Size()
	rowBytes := c.hidden * es
	noErrors(t, each(R, func(r int) error {
		d, o := rd[r], ref[r]
		rows := o.n
		if worst > 0 {
			rows = worst
		}
		o.recvX = make([]byte, rows*rowBytes)
		o.recvSc = make([]byte, rows*c.scales*4)
		o.recvSrc, o.recvTopk, o.recvW = make([]int32, rows), make([]int64, rows*K), make([]float32, rows*K)
		o.sendHead = make([]int32, d.T*R)
		var sc []byte
		if c.scales > 0 {
			sc = bytesOf(d.scales)
		} else {
			o.recvSc = nil
		}
		return normal.Dispatch(doms[r], &normal.DispatchArgs{Config: ncfg, NumTokens: d.T, HiddenBytes: rowBytes, ScalesBytes: c.scales * 4,
			NumTopk: K, NumExperts: E, X: d.x, XScales: sc, TopkIdx: d.topk, TopkWeights: d.w, IsTokenInRank: bools(d.inRank.b),
			RankPrefixMatrix: o.rankPrefix, ChannelPrefixMatrix: o.channelPrefix, NumWorstTokens: worst,
			RecvX: o.recvX, RecvXScales: o.recvSc, RecvSrcIdx: o.recvSrc, RecvTopkIdx: o.recvTopk, RecvTopkWeights: o.recvW,
			SendHead: o.sendHead})
	}))
	// Combine's rows: the received rows as the combine dtype (bf16 for FP8), scaled per rank.
	cdt := c.combineDT
	if cdt == (dlpack.DType{}) {
		cdt = c.dtype
	}
	ces := cdt.Size()
	// Round n's rows of rank r: its factor is (r + 1 + n) / 4.
	combineRows := func(r int, recv []byte, rows, round int) []byte {
		out := make([]byte, rows*c.hidden*ces)
		for i := 0; i < rows*c.hidden; i++ {
			var v float32
			switch c.dtype {
			case dlpack.BF16:
				v = normal.BF16ToF32(binary.LittleEndian.Uint16(recv[2*i:]))
			case dlpack.F16:
				v = normal.F16ToF32(binary.LittleEndian.Uint16(recv[2*i:]))
			case dlpack.F32:
				v = math.Float32frombits(binary.LittleEndian.Uint32(recv[4*i:]))
			default:
				v = float32(int8(recv[i])) / 8
			}
			putFloat(out, cdt, i, v*(float32(r+1+round)/4))
		}
		return out
	}
	for r, d := range rd {
		o := ref[r]
		rng := rand.New(rand.NewPCG(uint64(r)+100, 9))
		for i := 0; i < c.bias; i++ {
			b := make([]byte, d.T*c.hidden*ces)
			for j := 0; j < d.T*c.hidden; j++ {
				putFloat(b, cdt, j, float32(rng.NormFloat64()))
			}
			o.biases = append(o.biases, b)
		}
	}
	// refCombine is every rank's combined_x and combined_topk_weights of round n.
	refCombine := func(round int) ([][]byte, [][]float32) {
		combined, combinedW := make([][]byte, R), make([][]float32, R)
		noErrors(t, each(R, func(r int) error {
			d, o := rd[r], ref[r]
			var b0, b1 []byte
			if c.bias > 0 {
				b0 = o.biases[0]
			}
			if c.bias > 1 {
				b1 = o.biases[1]
			}
			combined[r], combinedW[r] = make([]byte, d.T*c.hidden*ces), make([]float32, d.T*K)
			return normal.Combine(doms[r], &normal.CombineArgs{Config: ncfg, DType: normalDType(cdt), Hidden: c.hidden, NumTopk: K,
				NumTokens: d.T, X: combineRows(r, o.recvX, len(o.recvSrc), round), TopkWeights: o.recvW, SrcIdx: o.recvSrc,
				RankPrefixMatrix: o.rankPrefix, ChannelPrefixMatrix: o.recvChannelPrefix, SendHead: o.sendHead, Bias0: b0, Bias1: b1,
				CombinedX: combined[r], CombinedTopkWeights: combinedW[r]})
		}))
		return combined, combinedW
	}

	// The GPU path.
	for r, e := range envs {
		d := rd[r]
		d.rankPrefix = e.alloc(t, dlpack.I32, int64(R), int64(R))
		d.channelPrefix = e.alloc(t, dlpack.I32, int64(R), int64(C))
		d.recvChannelPrefix = e.alloc(t, dlpack.I32, int64(R), int64(C))
		d.recvPerExpert = e.alloc(t, dlpack.I32, int64(E/R))
	}
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		n, err := envs[r].normal().Notify(peers[r], &goep.NotifyOp{Config: c.cfg, NumTokens: d.T, NumExperts: E,
			ExpertAlignment: c.align, NumWorstTokens: worst, PerRank: d.perRank.t, PerExpert: d.perExpert.t, InRank: d.inRank.t,
			RankPrefix: d.rankPrefix.t, ChannelPrefix: d.channelPrefix.t, RecvChannelPrefix: d.recvChannelPrefix.t,
			RecvPerExpert: d.recvPerExpert.t, TopkIdx: d.dTopk.t})
		d.n = n
		return err
	}))
	for r, d := range rd {
		o := ref[r]
		require.Equal(t, o.n, d.n, "rank %d num_recv", r)
		require.Equal(t, o.rankPrefix, i32s(d.rankPrefix.b), "rank %d rank_prefix", r)
		require.Equal(t, o.channelPrefix, i32s(d.channelPrefix.b), "rank %d channel_prefix", r)
		require.Equal(t, o.recvChannelPrefix, i32s(d.recvChannelPrefix.b), "rank %d recv_channel_prefix", r)
		require.Equal(t, o.recvPerExpert, i32s(d.recvPerExpert.b), "rank %d recv_per_expert", r)
		host, err := envs[r].normal().(goep.PerExpertCounter).RecvPerExpert()
		require.NoError(t, err)
		require.Equal(t, o.recvPerExpert, host, "rank %d recv_per_expert (host copy)", r)
	}
	for r, e := range envs {
		d := rd[r]
		rows := int64(d.n)
		if worst > 0 {
			rows = int64(worst)
		}
		d.recvX = e.alloc(t, c.dtype, rows, int64(c.hidden))
		if c.scales > 0 {
			d.recvSc = e.alloc(t, dlpack.F32, rows, int64(c.scales))
		}
		d.recvSrc = e.alloc(t, dlpack.I32, rows)
		d.recvTopk = e.alloc(t, dlpack.I64, rows, int64(K))
		d.recvW = e.alloc(t, dlpack.F32, rows, int64(K))
		d.sendH = e.alloc(t, dlpack.I32, int64(d.T), int64(R))
	}
	launched := make([]int64, R)
	for r, e := range envs {
		_, launched[r] = e.be.LaunchStamps()
	}
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		st, ss := c.scaleStrides(d.T)
		return envs[r].normal().Dispatch(peers[r], &goep.DispatchOp{Config: c.cfg, NumTokens: d.T, HiddenBytes: rowBytes,
			ScalesBytes: c.scales * 4, ScalesTokenStride: st, ScalesStride: ss, NumTopk: K, NumExperts: E, NumWorstTokens: worst,
			X: d.dX.t, XScales: d.dSc.t,
			TopkIdx: d.dTopk.t, TopkWeights: d.dW.t, InRank: d.inRank.t, RankPrefix: d.rankPrefix.t, ChannelPrefix: d.channelPrefix.t,
			RecvX: d.recvX.t, RecvXScales: d.recvSc.t, RecvSrcIdx: d.recvSrc.t, RecvTopkIdx: d.recvTopk.t,
			RecvTopkWeights: d.recvW.t, SendHead: d.sendH.t})
	}))
	for r, e := range envs {
		start, end := e.be.LaunchStamps()
		assert.Greater(t, start, launched[r], "rank %d: the dispatch's launch is stamped", r)
		assert.GreaterOrEqual(t, end, start, "rank %d: the launch's stamps are in order", r)
	}
	for r, d := range rd {
		o := ref[r]
		require.Equal(t, o.recvX, d.recvX.b, "rank %d recv_x", r)
		if c.scales > 0 {
			require.Equal(t, o.recvSc, d.recvSc.b, "rank %d recv_x_scales", r)
		}
		require.Equal(t, o.recvSrc, i32s(d.recvSrc.b), "rank %d recv_src_idx", r)
		require.Equal(t, o.recvTopk, i64s(d.recvTopk.b), "rank %d recv_topk_idx", r)
		require.Equal(t, o.recvW, f32s(d.recvW.b), "rank %d recv_topk_weights", r)
		require.Equal(t, o.sendHead, i32s(d.sendH.b), "rank %d send_head", r)
	}

	// Cached dispatch of round n (the same rows again; from round 1 on, every byte of rank s's x
	// xor n * (0x35 + 0x11 s), so that no round's rows are another's) on the ranks of only.
	mask := func(round, s int) byte { return byte(round * (0x35 + 0x11*s)) }
	rounds := &caseRounds{}
	for _, d := range rd {
		rounds.inRank = append(rounds.inRank, d.inRank)
	}
	cachedRound := func(round int, only ...int) []error {
		xs, cached := make([]dev, R), make([]dev, R)
		for r, e := range envs {
			d := rd[r]
			x := append([]byte(nil), d.x...)
			for i := range x {
				x[i] ^= mask(round, r)
			}
			xs[r] = e.upload(t, c.dtype, x, int64(d.T), int64(c.hidden))
			cached[r] = e.alloc(t, c.dtype, int64(len(ref[r].recvSrc)), int64(c.hidden))
		}
		errs := eachOf(R, only, rounds.before, func(r int) error {
			d := rd[r]
			return envs[r].normal().Dispatch(peers[r], &goep.DispatchOp{Config: c.cfg, NumTokens: d.T, HiddenBytes: rowBytes,
				NumWorstTokens: worst, X: xs[r].t, InRank: d.inRank.t, RankPrefix: d.rankPrefix.t, ChannelPrefix: d.channelPrefix.t,
				RecvX: cached[r].t})
		})
		if len(only) > 0 || slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
			return errs
		}
		for r, o := range ref {
			// Rows [rank_prefix[s-1, r], rank_prefix[s, r]) came from rank s; padding rows stay zero.
			want := slices.Clone(o.recvX)
			lo := 0
			for s := range R {
				hi := int(o.rankPrefix[s*R+r])
				for i := lo * rowBytes; i < hi*rowBytes; i++ {
					want[i] ^= mask(round, s)
				}
				lo = hi
			}
			require.Equal(t, want, cached[r].b, "rank %d cached recv_x (round %d)", r, round)
		}
		return errs
	}
	noErrors(t, cachedRound(0))
	if worst == 0 {
		runQueued(t, envs, c, topo, peers, func(r int) (queuedIn, queuedOut) {
			d, o := rd[r], ref[r]
			return queuedIn{T: d.T, x: d.dX, sc: d.dSc, topk: d.dTopk, w: d.dW, perRank: d.perRank, perExpert: d.perExpert,
					inRank: d.inRank},
				queuedOut{n: o.n, recvX: o.recvX, recvSc: o.recvSc, recvSrc: o.recvSrc, recvTopk: o.recvTopk, recvW: o.recvW,
					sendHead: o.sendHead}
		})
	}

	// Combine of round n on the ranks of only.
	combineRound := func(round int, only ...int) []error {
		outs, outW, ys := make([]dev, R), make([]dev, R), make([]dev, R)
		biases := make([][2]dev, R)
		for r, e := range envs {
			d, o := rd[r], ref[r]
			rows := int64(len(o.recvSrc))
			ys[r] = e.upload(t, cdt, combineRows(r, d.recvX.b, int(rows), round), rows, int64(c.hidden))
			for i, b := range o.biases {
				biases[r][i] = e.upload(t, cdt, b, int64(d.T), int64(c.hidden))
			}
			outs[r] = e.alloc(t, cdt, int64(d.T), int64(c.hidden))
			outW[r] = e.alloc(t, dlpack.F32, int64(d.T), int64(K))
		}
		errs := eachOf(R, only, rounds.before, func(r int) error {
			d := rd[r]
			return envs[r].normal().Combine(peers[r], &goep.CombineOp{Config: c.cfg, NumTokens: d.T, Hidden: c.hidden, NumTopk: K,
				X: ys[r].t, TopkWeights: d.recvW.t, SrcIdx: d.recvSrc.t, RankPrefix: d.rankPrefix.t, ChannelPrefix: d.recvChannelPrefix.t,
				SendHead: d.sendH.t, Bias0: biases[r][0].t, Bias1: biases[r][1].t, CombinedX: outs[r].t, CombinedTopkWeights: outW[r].t})
		})
		if len(only) > 0 || slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
			return errs
		}
		combined, combinedW := refCombine(round)
		for r := range rd {
			require.Equal(t, combined[r], outs[r].b, "rank %d combined_x (round %d)", r, round)
			require.Equal(t, combinedW[r], f32s(outW[r].b), "rank %d combined_topk_weights (round %d)", r, round)
		}
		return errs
	}
	noErrors(t, combineRound(0))
	rounds.cached, rounds.combine = cachedRound, combineRound
	return rounds
}

// caseRounds are more calls on the handle of runCase's dispatch: round n of a cached dispatch or
// a combine (from round 1 on, inputs that differ from every other round's) on the ranks of only
// (every rank if none), each rank's error returned. When every rank made the call and none
// failed, the outputs are checked bit for bit against the reference's. before, if set, runs in
// each rank's goroutine before its call. inRank is each rank's is_token_in_rank, which the cached
// dispatches read.
type caseRounds struct {
	cached, combine func(round int, only ...int) []error
	before          func(r int)
	inRank          []dev
}

type queuedIn struct {
	T                                          int
	x, sc, topk, w, perRank, perExpert, inRank dev
}

type queuedOut struct {
	n             int
	recvX, recvSc []byte
	recvSrc       []int32
	recvTopk      []int64
	recvW         []float32
	sendHead      []int32
}

// runQueued checks NotifyDispatch against the reference: once with room for every rank's rows
// (the dispatch runs), once with one row each (it runs only if no rank receives more; otherwise
// nothing moves, and a Dispatch into exact rows follows, as after Notify). Either way it is one
// launch (intranode.cu's pyep_notify_dispatch: notify in block 0, the data blocks after it).
func runQueued(t *testing.T, envs []*rankEnv, c rcase, topo []goep.Topology, peers [][]goep.Region, of func(r int) (queuedIn, queuedOut)) {
	R, K, E, C := c.R, c.K, c.E, c.cfg.NumChannels()
	rowBytes := c.hidden * c.dtype.Size()
	for _, spare := range []int{3, -1} {
		capOf := func(r int) int {
			if spare < 0 {
				return 1
			}
			_, want := of(r)
			return want.n + spare
		}
		fit := true
		for r := range envs {
			_, want := of(r)
			fit = fit && want.n <= capOf(r)
		}
		type outs struct{ recvX, recvSc, recvSrc, recvTopk, recvW, sendH, rp, cp, rcp, rpe dev }
		alloc := func(e *rankEnv, rows int64, T int) outs {
			var o outs
			o.recvX = e.alloc(t, c.dtype, rows, int64(c.hidden))
			if c.scales > 0 {
				o.recvSc = e.alloc(t, dlpack.F32, rows, int64(c.scales))
			}
			o.recvSrc = e.alloc(t, dlpack.I32, rows)
			o.recvTopk = e.alloc(t, dlpack.I64, rows, int64(K))
			o.recvW = e.alloc(t, dlpack.F32, rows, int64(K))
			o.sendH = e.alloc(t, dlpack.I32, int64(T), int64(R))
			o.rp = e.alloc(t, dlpack.I32, int64(R), int64(R))
			o.cp = e.alloc(t, dlpack.I32, int64(R), int64(C))
			o.rcp = e.alloc(t, dlpack.I32, int64(R), int64(C))
			o.rpe = e.alloc(t, dlpack.I32, int64(E/R))
			return o
		}
		op := func(in queuedIn, o outs) *goep.DispatchOp {
			st, ss := c.scaleStrides(in.T)
			return &goep.DispatchOp{Config: c.cfg, NumTokens: in.T, HiddenBytes: rowBytes, ScalesBytes: c.scales * 4,
				ScalesTokenStride: st, ScalesStride: ss, NumTopk: K,
				NumExperts: E, X: in.x.t, XScales: in.sc.t, TopkIdx: in.topk.t, TopkWeights: in.w.t, InRank: in.inRank.t,
				RankPrefix: o.rp.t, ChannelPrefix: o.cp.t, RecvX: o.recvX.t, RecvXScales: o.recvSc.t, RecvSrcIdx: o.recvSrc.t,
				RecvTopkIdx: o.recvTopk.t, RecvTopkWeights: o.recvW.t, SendHead: o.sendH.t}
		}
		got := make([]outs, R)
		ns, ran, launches := make([]int, R), make([]bool, R), make([]int, R)
		for r, e := range envs {
			in, _ := of(r)
			got[r] = alloc(e, int64(capOf(r)), in.T)
		}
		noErrors(t, each(R, func(r int) error {
			in, _ := of(r)
			o := got[r]
			var err error
			before := envs[r].drv.Calls("LaunchKernel")
			ns[r], ran[r], err = envs[r].normal().(goep.SpeculativeEngine).NotifyDispatch(peers[r], &goep.NotifyOp{Config: c.cfg, NumTokens: in.T,
				NumExperts: E, ExpertAlignment: c.align, PerRank: in.perRank.t, PerExpert: in.perExpert.t, InRank: in.inRank.t,
				RankPrefix: o.rp.t, ChannelPrefix: o.cp.t, RecvChannelPrefix: o.rcp.t, RecvPerExpert: o.rpe.t,
				TopkIdx: in.topk.t, Capacity: capOf(r)}, op(in, o))
			launches[r] = envs[r].drv.Calls("LaunchKernel") - before
			return err
		}))
		for r := range envs {
			_, want := of(r)
			require.Equal(t, want.n, ns[r], "rank %d num_recv (spare %d)", r, spare)
			require.Equal(t, fit, ran[r], "rank %d: the dispatch ran (spare %d)", r, spare)
			require.Equal(t, 1, launches[r], "rank %d: notify and the data blocks in one launch (spare %d)", r, spare)
		}
		if !fit {
			for r := range envs {
				// No data block ran: the outputs are as allocated.
				assert.True(t, untouched(got[r].recvX.b), "rank %d: recv_x written by a dispatch that did not run", r)
				assert.True(t, untouched(got[r].sendH.b), "rank %d: send_head written by a dispatch that did not run", r)
			}
			exact := make([]outs, R)
			for r, e := range envs {
				in, _ := of(r)
				exact[r] = alloc(e, int64(ns[r]), in.T)
				exact[r].rp, exact[r].cp = got[r].rp, got[r].cp
			}
			noErrors(t, each(R, func(r int) error {
				in, _ := of(r)
				return envs[r].normal().Dispatch(peers[r], op(in, exact[r]))
			}))
			got = exact
		}
		for r := range envs {
			_, want := of(r)
			n, o := want.n, got[r]
			require.Equal(t, want.recvX, o.recvX.b[:n*rowBytes], "rank %d queued recv_x (spare %d)", r, spare)
			if c.scales > 0 {
				require.Equal(t, want.recvSc, o.recvSc.b[:n*c.scales*4], "rank %d queued recv_x_scales", r)
			}
			require.Equal(t, want.recvSrc, i32s(o.recvSrc.b)[:n], "rank %d queued recv_src_idx", r)
			require.Equal(t, want.recvTopk, i64s(o.recvTopk.b)[:n*K], "rank %d queued recv_topk_idx", r)
			require.Equal(t, want.recvW, f32s(o.recvW.b)[:n*K], "rank %d queued recv_topk_weights", r)
			require.Equal(t, want.sendHead, i32s(o.sendH.b), "rank %d queued send_head", r)
		}
	}
}

// untouched reports whether b holds what alloc filled it with.
func untouched(b []byte) bool {
	return !slices.ContainsFunc(b, func(v byte) bool { return v != 0xcd })
}

// eachOf is each over the ranks of only (every rank when it is empty), calling before(r) (when
// set) ahead of f(r).
func eachOf(R int, only []int, before func(int), f func(r int) error) []error {
	return each(R, func(r int) error {
		if len(only) > 0 && !slices.Contains(only, r) {
			return nil
		}
		if before != nil {
			before(r)
		}
		return f(r)
	})
}
