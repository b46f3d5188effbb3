package normal

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// combineCase is the combine half of a round.
type combineCase struct {
	dtype     DType
	hidden    int
	nbias     int
	noWeights bool // combine without topk_weights
}

// mix is a small deterministic hash for synthetic combine payloads.
func mix(a ...int) uint64 {
	h := uint64(0x9E3779B97F4A7C15)
	for _, v := range a {
		h ^= uint64(v) + 0x9E3779B97F4A7C15 + h<<6 + h>>2
		h *= 0xBF58476D1CE4E5B9
	}
	return h ^ h>>31
}

// elem is the synthetic value a rank returns for (tag, src, t, j), already
// representable in dt.
func elem(dt DType, tag, src, t, j int) float32 {
	f := float32(int(mix(tag, src, t, j)%2001)-1000) / 97
	switch dt {
	case BFloat16:
		return BF16ToF32(F32ToBF16(f))
	case Float16:
		return F16ToF32(F32ToF16(f))
	}
	return f
}

func putElem(b []byte, i int, dt DType, v float32) {
	switch dt {
	case BFloat16:
		*(*uint16)(unsafe.Pointer(&b[2*i])) = F32ToBF16(v)
	case Float16:
		*(*uint16)(unsafe.Pointer(&b[2*i])) = F32ToF16(v)
	case Float32:
		*(*float32)(unsafe.Pointer(&b[4*i])) = v
	}
}

func getElem(b []byte, i int, dt DType) float32 {
	switch dt {
	case BFloat16:
		return BF16ToF32(*(*uint16)(unsafe.Pointer(&b[2*i])))
	case Float16:
		return F16ToF32(*(*uint16)(unsafe.Pointer(&b[2*i])))
	}
	return *(*float32)(unsafe.Pointer(&b[4*i]))
}

func round(dt DType, f float32) float32 {
	switch dt {
	case BFloat16:
		return BF16ToF32(F32ToBF16(f))
	case Float16:
		return F16ToF32(F32ToF16(f))
	}
	return f
}

// alignedBytes returns n bytes 8-byte aligned, as Python tensors are.
func alignedBytes(n int) []byte {
	if n == 0 {
		return []byte{}
	}
	w := make([]uint64, (n+7)/8)
	return unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), n)
}

func scenarioBytes(sc *scenario, cc combineCase) int64 {
	n := max(NotifyBufferBytes(sc.R, sc.cfg.NumChannels(), sc.E),
		DispatchBufferBytes(sc.cfg, sc.R, sc.hiddenBytes, sc.scalesBytes, sc.K))
	if cc.dtype != 0 {
		n = max(n, CombineBufferBytes(sc.cfg, sc.R, cc.hidden*cc.dtype.Size(), sc.K))
	}
	return align(n, 128)
}

// checkRound runs layout, notify, dispatch, a cached dispatch and a combine
// for one scenario on s and compares everything with the reference.
func checkRound(t *testing.T, s *sim, sc *scenario, cc combineCase, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	in := makeInputs(rng, sc)
	ref := reference(sc, in)
	R, C, K := sc.R, sc.cfg.NumChannels(), sc.K

	out, errs := runDispatch(s, sc, in)
	requireNoErrors(t, errs)
	for r := 0; r < R; r++ {
		if !s.local(r) {
			continue
		}
		o, e := &out[r], &ref[r]
		msg := fmt.Sprintf("rank %d", r)
		require.Equal(t, e.perRank, o.perRank, msg)
		require.Equal(t, e.perExpert, o.perExpert, msg)
		require.Equal(t, e.inRank, o.inRank, msg)
		assert.Equal(t, e.rpm, o.rpm, msg)
		assert.Equal(t, e.cpm, o.cpm, msg)
		assert.Equal(t, e.rcpm, o.rcpm, msg)
		assert.Equal(t, e.rcpm, o.rcpm2, msg)
		assert.Equal(t, e.recvExp, o.recvExp, msg)
		assert.Equal(t, e.numRecv, o.res.NumRecvTokens, msg)
		for j := 0; j < R; j++ {
			assert.Equal(t, ref[j].numRecv, o.res.NumRecvTokensPerRank[j], msg)
		}
		if !assert.True(t, bytesEqual(e.x, o.x), "%s: recv_x differs", msg) {
			return
		}
		assert.True(t, bytesEqual(e.scales, o.scales), "%s: recv_x_scales differs", msg)
		assert.Equal(t, e.srcIdx, o.srcIdx, msg)
		assert.Equal(t, e.topk, o.topk, msg)
		assert.Equal(t, e.weights, o.weights, msg)
		assert.Equal(t, e.sendHead, o.sendHead, msg)
	}
	if t.Failed() {
		return
	}

	// Cached dispatch of new payloads with the handle.
	x2 := make([][]byte, R)
	sc2 := make([][]byte, R)
	for r := range x2 {
		x2[r] = make([]byte, len(in[r].x))
		for i := range x2[r] {
			x2[r][i] = byte(rng.Uint32())
		}
		if sc.scalesBytes > 0 {
			sc2[r] = make([]byte, len(in[r].scales))
			for i := range sc2[r] {
				sc2[r][i] = byte(rng.Uint32())
			}
		}
	}
	cx := make([][]byte, R)
	cs := make([][]byte, R)
	crcpm := make([][]int32, R)
	errs = s.each(func(r int, d *Domain) error {
		o := &out[r]
		rows := len(o.srcIdx)
		cx[r] = make([]byte, rows*sc.hiddenBytes)
		if sc.scalesBytes > 0 {
			cs[r] = make([]byte, rows*sc.scalesBytes)
		}
		crcpm[r] = make([]int32, R*C)
		return Dispatch(d, &DispatchArgs{Config: sc.cfg, NumTokens: in[r].T, HiddenBytes: sc.hiddenBytes, ScalesBytes: sc.scalesBytes,
			X: x2[r], XScales: sc2[r], IsTokenInRank: o.inRank, RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.cpm,
			NumWorstTokens: sc.worst, RecvX: cx[r], RecvXScales: cs[r], RecvChannelPrefixMatrix: crcpm[r]})
	})
	requireNoErrors(t, errs)
	for r := 0; r < R; r++ {
		if !s.local(r) {
			continue
		}
		e := &ref[r]
		wantX := make([]byte, len(cx[r]))
		wantS := make([]byte, len(cs[r]))
		for i := 0; i < e.numRecv; i++ {
			src, tok := int(e.recvSrc[i]), int(e.srcIdx[i])
			copy(wantX[i*sc.hiddenBytes:], x2[src][tok*sc.hiddenBytes:(tok+1)*sc.hiddenBytes])
			if sc.scalesBytes > 0 {
				copy(wantS[i*sc.scalesBytes:], sc2[src][tok*sc.scalesBytes:(tok+1)*sc.scalesBytes])
			}
		}
		assert.True(t, bytesEqual(wantX, cx[r]), "rank %d: cached recv_x differs", r)
		assert.True(t, bytesEqual(wantS, cs[r]), "rank %d: cached recv_x_scales differs", r)
		assert.Equal(t, e.rcpm, crcpm[r], "rank %d: cached recv_channel_prefix_matrix", r)
	}

	if cc.dtype == 0 {
		return
	}
	// Combine: every rank returns synthetic rows (a function of who returns
	// which token) and the weights it received.
	H, dt, es := cc.hidden, cc.dtype, cc.dtype.Size()
	if cc.noWeights {
		K = 0
	}
	combined := make([][]byte, R)
	combinedW := make([][]float32, R)
	biases := make([][2][]byte, R)
	errs = s.each(func(r int, d *Domain) error {
		o, e := &out[r], &ref[r]
		rows := len(o.srcIdx)
		x := alignedBytes(rows * H * es)
		for i := 0; i < e.numRecv; i++ {
			for j := 0; j < H; j++ {
				putElem(x, i*H+j, dt, elem(dt, r, int(e.recvSrc[i]), int(e.srcIdx[i]), j))
			}
		}
		T := in[r].T
		var b [2][]byte
		for bi := 0; bi < cc.nbias; bi++ {
			b[bi] = alignedBytes(T * H * es)
			for tok := 0; tok < T; tok++ {
				for j := 0; j < H; j++ {
					putElem(b[bi], tok*H+j, dt, elem(dt, 100+bi, r, tok, j))
				}
			}
		}
		biases[r] = b
		combined[r] = alignedBytes(T * H * es)
		if K > 0 {
			combinedW[r] = make([]float32, T*K)
		}
		weights := o.weights
		if K == 0 {
			weights = nil
		}
		return Combine(d, &CombineArgs{Config: sc.cfg, DType: dt, Hidden: H, NumTopk: K, NumTokens: T,
			X: x, TopkWeights: weights, SrcIdx: o.srcIdx, RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.rcpm2,
			SendHead: o.sendHead, Bias0: b[0], Bias1: b[1], CombinedX: combined[r], CombinedTopkWeights: combinedW[r]})
	})
	requireNoErrors(t, errs)
	for r := 0; r < R; r++ {
		if !s.local(r) {
			continue
		}
		T := in[r].T
		want := alignedBytes(T * H * es)
		wantW := make([]float32, T*K)
		for tok := 0; tok < T; tok++ {
			for j := 0; j < H; j++ {
				var acc float32
				for bi := 0; bi < cc.nbias; bi++ {
					acc += getElem(biases[r][bi], tok*H+j, dt)
				}
				for dst := 0; dst < R; dst++ {
					if ref[r].inRank[tok*R+dst] {
						acc += elem(dt, dst, r, tok, j)
					}
				}
				putElem(want, tok*H+j, dt, acc)
			}
			for k := 0; k < K; k++ {
				var acc float32
				for dst := 0; dst < R; dst++ {
					if e := in[r].topk[tok*sc.K+k]; ref[r].inRank[tok*R+dst] && e >= 0 && int(e)/(sc.E/R) == dst {
						acc += in[r].weights[tok*sc.K+k]
					}
				}
				wantW[k+tok*K] = acc
			}
		}
		if !assert.True(t, bytesEqual(want, combined[r]), "rank %d: combined_x differs", r) {
			for i := 0; i < T*H; i++ {
				if g, w := getElem(combined[r], i, dt), getElem(want, i, dt); g != w {
					t.Logf("first difference at token %d elem %d: got %v want %v", i/H, i%H, g, w)
					break
				}
			}
		}
		if K > 0 {
			assert.Equal(t, wantW, combinedW[r], "rank %d: combined_topk_weights", r)
		}
	}
}

func bytesEqual(a, b []byte) bool { return string(a) == string(b) }

func toOne(rank int) func(*rand.Rand, *scenario, int, int) []int64 {
	return func(rng *rand.Rand, sc *scenario, _, _ int) []int64 {
		epr := sc.E / sc.R
		row := make([]int64, sc.K)
		for k := range row {
			row[k] = int64(rank*epr + rng.IntN(epr))
		}
		return row
	}
}

func silentRank(rank int) func(*rand.Rand, *scenario, int, int) []int64 {
	return func(rng *rand.Rand, sc *scenario, r, t int) []int64 {
		if r == rank {
			row := make([]int64, sc.K)
			for k := range row {
				row[k] = -1
			}
			return row
		}
		return randomRoute(rng, sc, r, t)
	}
}

func TestRoundTrip(t *testing.T) {
	small := Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 4, NumMaxNVLChunkedRecvTokens: 16}
	bf := func(h, nb int) combineCase { return combineCase{dtype: BFloat16, hidden: h, nbias: nb} }
	cases := []struct {
		sc scenario
		cc combineCase
	}{
		{scenario{name: "r1", R: 1, E: 4, K: 2, tokens: []int{37}, hiddenBytes: 64, cfg: small}, bf(32, 1)},
		{scenario{name: "r2 scales", R: 2, E: 8, K: 4, tokens: []int{100, 77}, hiddenBytes: 256, scalesBytes: 16,
			cfg: Config{NumSMs: 6, NumMaxNVLChunkedSendTokens: 3, NumMaxNVLChunkedRecvTokens: 8}}, bf(128, 2)},
		{scenario{name: "r3 rank with no tokens", R: 3, E: 6, K: 2, tokens: []int{50, 0, 64}, hiddenBytes: 32, cfg: small}, bf(16, 0)},
		{scenario{name: "r3 rank routes nothing", R: 3, E: 9, K: 3, tokens: []int{40, 41, 42}, hiddenBytes: 32, cfg: small,
			route: silentRank(1)}, bf(16, 1)},
		{scenario{name: "r4 rank receives nothing", R: 4, E: 16, K: 4, tokens: []int{60, 61, 62, 63}, hiddenBytes: 64, cfg: small,
			noRecvRank: 2}, bf(32, 2)},
		{scenario{name: "r4 all to rank 1", R: 4, E: 8, K: 2, tokens: []int{30, 31, 32, 33}, hiddenBytes: 64, cfg: small,
			route: toOne(1)}, bf(32, 0)},
		{scenario{name: "r4 zero tokens", R: 4, E: 8, K: 2, tokens: []int{0, 0, 0, 0}, hiddenBytes: 64, cfg: small}, bf(32, 1)},
		{scenario{name: "r8 topk 1", R: 8, E: 16, K: 1, tokens: []int{20, 21, 22, 23, 24, 25, 26, 0}, hiddenBytes: 16, cfg: small}, bf(8, 1)},
		{scenario{name: "r8 topk 8", R: 8, E: 64, K: 8, tokens: []int{20, 21, 22, 23, 24, 25, 26, 27}, hiddenBytes: 16, cfg: small}, bf(8, 2)},
		{scenario{name: "r4 topk 9", R: 4, E: 16, K: 9, tokens: []int{20, 21, 22, 23}, hiddenBytes: 16, cfg: small}, bf(8, 0)},
		{scenario{name: "r8 hidden 7168 bf16", R: 8, E: 32, K: 8, tokens: []int{240, 170, 90, 300, 0, 120, 250, 80}, hiddenBytes: 7168 * 2,
			cfg: Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 3, NumMaxNVLChunkedRecvTokens: 8}}, bf(7168, 2)},
		{scenario{name: "r4 fp8 7168 with scales", R: 4, E: 32, K: 8, tokens: []int{40, 33, 20, 37}, hiddenBytes: 7168, scalesBytes: 7168 / 128 * 4,
			cfg: Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 3, NumMaxNVLChunkedRecvTokens: 8}}, bf(7168, 1)},
		{scenario{name: "r4 fp8 column-major scales", R: 4, E: 32, K: 8, tokens: []int{40, 33, 0, 37}, hiddenBytes: 512, scalesBytes: 512 / 128 * 4,
			colScales: true, cfg: Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 3, NumMaxNVLChunkedRecvTokens: 8}}, bf(512, 1)},
		{scenario{name: "r2 padded column-major scales", R: 2, E: 8, K: 4, tokens: []int{1, 29}, hiddenBytes: 256, scalesBytes: 12,
			colScales: true, colScalePad: 3, cfg: small}, bf(128, 0)},
		{scenario{name: "r2 hidden 2880 bf16", R: 2, E: 4, K: 2, tokens: []int{70, 65}, hiddenBytes: 2880 * 2, cfg: small}, bf(2880, 2)},
		{scenario{name: "r3 odd row bytes", R: 3, E: 3, K: 1, tokens: []int{33, 34, 35}, hiddenBytes: 7, scalesBytes: 3, cfg: small},
			combineCase{dtype: Float16, hidden: 5, nbias: 1}},
		{scenario{name: "r4 alignment 128", R: 4, E: 16, K: 4, tokens: []int{50, 50, 50, 50}, hiddenBytes: 32, cfg: small, align: 128},
			combineCase{dtype: Float32, hidden: 9, nbias: 2}},
		{scenario{name: "r4 worst tokens", R: 4, E: 16, K: 4, tokens: []int{50, 40, 30, 20}, hiddenBytes: 32, cfg: small, worst: 200},
			bf(16, 1)},
		{scenario{name: "r4 deepep config, buffer = size hint", R: 4, E: 64, K: 8, tokens: []int{500, 400, 300, 200}, hiddenBytes: 512,
			scalesBytes: 16, cfg: Config{NumSMs: 24, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256},
			numBytes: NVLBufferSizeHint(Config{NumSMs: 24, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256}, 512, 4)},
			bf(256, 2)},
		{scenario{name: "r3 one worker", R: 3, E: 6, K: 2, tokens: []int{300, 200, 100}, hiddenBytes: 48, cfg: Config{NumSMs: 10,
			NumMaxNVLChunkedSendTokens: 2, NumMaxNVLChunkedRecvTokens: 5}, workers: 1}, combineCase{dtype: BFloat16, hidden: 24, nbias: 1, noWeights: true}},
		{scenario{name: "r3 three workers", R: 3, E: 6, K: 2, tokens: []int{300, 200, 100}, hiddenBytes: 48, cfg: Config{NumSMs: 10,
			NumMaxNVLChunkedSendTokens: 2, NumMaxNVLChunkedRecvTokens: 5}, workers: 3}, bf(24, 2)},
		{scenario{name: "r4 small rings 4096 tokens", R: 4, E: 16, K: 4, tokens: []int{4096, 4096, 4096, 4096}, hiddenBytes: 64,
			cfg: Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 4, NumMaxNVLChunkedRecvTokens: 8}}, bf(32, 1)},
		{scenario{name: "r8 small rings 4096 tokens", R: 8, E: 16, K: 2, tokens: []int{4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096}, hiddenBytes: 32,
			cfg: Config{NumSMs: 2, NumMaxNVLChunkedSendTokens: 2, NumMaxNVLChunkedRecvTokens: 8}}, bf(16, 0)},
	}
	for i, tc := range cases {
		sc := tc.sc
		if sc.noRecvRank == 0 {
			sc.noRecvRank = -1
		}
		if testing.Short() {
			var volume int
			for _, n := range sc.tokens {
				volume += n * (sc.hiddenBytes + 64)
			}
			if volume > 1<<20 || sc.tokens[0] > 1000 {
				sc.tokens = append([]int(nil), sc.tokens...)
				for r := range sc.tokens {
					sc.tokens[r] /= 8
				}
			}
		}
		t.Run(sc.name, func(t *testing.T) {
			n := sc.numBytes
			if n == 0 {
				n = scenarioBytes(&sc, tc.cc)
			}
			s := newSim(t, sc.R, n, 20*time.Second)
			for _, d := range s.doms {
				d.Workers = sc.workers
			}
			checkRound(t, s, &sc, tc.cc, uint64(i))
		})
	}
}
