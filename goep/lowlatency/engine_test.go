package lowlatency

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// group is R engines over regions in this process's memory, as the ranks' processes see them.
type group struct {
	engines []*Engine
	mem     [][]byte
}

func newGroup(t *testing.T, R int, s Shape, shrink bool, timeout time.Duration) *group {
	t.Helper()
	size, err := SizeHint(R, s)
	require.NoError(t, err)
	g := &group{}
	regions := make([]unsafe.Pointer, R)
	for r := range R {
		m := make([]byte, size+align)
		off := (align - int(uintptr(unsafe.Pointer(&m[0])))%align) % align
		g.mem = append(g.mem, m)
		regions[r] = unsafe.Pointer(&m[off])
	}
	for r := range R {
		e, err := NewEngine(Domain{Rank: r, NumRanks: R, Regions: regions, NumBytes: size, Timeout: timeout, Shrink: shrink})
		require.NoError(t, err)
		g.engines = append(g.engines, e)
	}
	return g
}

// each runs f on every rank at once and returns their errors.
func (g *group) each(f func(r int, e *Engine) error) []error {
	errs := make([]error, len(g.engines))
	var wg sync.WaitGroup
	for r, e := range g.engines {
		wg.Add(1)
		go func() { defer wg.Done(); errs[r] = f(r, e) }()
	}
	wg.Wait()
	return errs
}

type rankInput struct {
	T    int
	x    []uint16
	topk []int64
	w    []float32
}

func inputs(rng *rand.Rand, R, K int, s Shape, tokens []int) []rankInput {
	in := make([]rankInput, R)
	for r := range R {
		T := tokens[r]
		in[r] = rankInput{T: T, x: make([]uint16, T*s.Hidden), topk: make([]int64, T*K), w: make([]float32, T*K)}
		for i := range in[r].x {
			in[r].x[i] = f32ToBF16(float32(rng.NormFloat64()))
		}
		for t := range T {
			experts := rng.Perm(s.NumExperts)
			for k := range K {
				in[r].topk[t*K+k] = -1
				if k < len(experts) && rng.IntN(5) > 0 { // -1 too
					in[r].topk[t*K+k] = int64(experts[k])
				}
				in[r].w[t*K+k] = rng.Float32()
			}
		}
	}
	return in
}

func dispatchArgs(s Shape, R, K int, in rankInput, fp8, round, ue8m0 bool) *DispatchArgs {
	L, RM := s.NumExperts/R, R*s.MaxTokens
	rowBytes, S := 2*s.Hidden, 0
	if fp8 {
		rowBytes, S = s.Hidden, s.Hidden/ScaleBlock
		if ue8m0 {
			S = (S + 3) / 4
		}
	}
	return &DispatchArgs{Shape: s, NumTokens: in.T, NumTopk: K, X: in.x, TopkIdx: in.topk,
		UseFP8: fp8, RoundScale: round, UseUE8M0: ue8m0,
		RecvX: make([]byte, L*RM*rowBytes), RecvScales: make([]uint32, L*RM*S), SrcInfo: make([]int32, L*RM),
		LayoutRange: make([]int64, L*R), Count: make([]int32, L), CumStats: make([]int32, L), WaitStats: make([]int64, R)}
}

// expectRows is what rank r's local expert j receives: (source rank, token) in order.
func expectRows(in []rankInput, K, L, g int) [][2]int {
	var rows [][2]int
	for s, ri := range in {
		for t := range ri.T {
			for k := range K {
				if ri.topk[t*K+k] == int64(g) {
					rows = append(rows, [2]int{s, t})
				}
			}
		}
	}
	return rows
}

// An expert's output of its bf16 row x: the row itself, or the row scaled by (g + 1) / 4.
func identity(g int, x []uint16) []uint16 { return x }

func scaled(g int, x []uint16) []uint16 {
	y := make([]uint16, len(x))
	for c, v := range x {
		y[c] = f32ToBF16(bf16ToF32(v) * float32(g+1) / 4)
	}
	return y
}

// refCombine is the combine of a rank's tokens in, by its definition: the terms of the ranks
// that a token selected (masked ranks left out), added in float32 in the order of each rank's
// first selection and rounded to bf16 once. A rank's term is w * expert(g, x) in float32 when
// the token selected one of its experts; when it selected several, the rank's float32 sum of
// those products in k order, rounded to bf16.
func refCombine(in rankInput, K, L, H int, masked []bool, expert func(g int, x []uint16) []uint16) []uint16 {
	out := make([]uint16, in.T*H)
	for t := range in.T {
		x := in.x[t*H : (t+1)*H]
		byRank := map[int][]int{} // rank: its selections k
		var order []int           // ranks by first selection
		for k := range K {
			if g := int(in.topk[t*K+k]); g >= 0 {
				if byRank[g/L] == nil {
					order = append(order, g/L)
				}
				byRank[g/L] = append(byRank[g/L], k)
			}
		}
		acc := make([]float32, H)
		for _, r := range order {
			if masked != nil && masked[r] {
				continue
			}
			term := make([]float32, H)
			for _, k := range byRank[r] {
				y := expert(int(in.topk[t*K+k]), x)
				for c := range H {
					term[c] += float32(bf16ToF32(y[c]) * in.w[t*K+k])
				}
			}
			for c := range H {
				if len(byRank[r]) > 1 {
					term[c] = bf16ToF32(f32ToBF16(term[c]))
				}
				acc[c] += term[c]
			}
		}
		for c := range H {
			out[t*H+c] = f32ToBF16(acc[c])
		}
	}
	return out
}

func TestDispatchCombine(t *testing.T) {
	cases := []struct {
		name              string
		R, M, H, E, K     int
		fp8, round, ue8m0 bool
		hook              bool
		tokens            []int // per rank; nil: M each
	}{
		{name: "1 rank bf16", R: 1, M: 4, H: 128, E: 3, K: 2},
		{name: "2 ranks bf16 hook", R: 2, M: 8, H: 256, E: 4, K: 3, hook: true},
		{name: "3 ranks fp8, an empty rank", R: 3, M: 5, H: 384, E: 6, K: 4, fp8: true, tokens: []int{5, 0, 3}},
		{name: "4 ranks fp8 round", R: 4, M: 6, H: 128, E: 8, K: 11, fp8: true, round: true},
		{name: "4 ranks ue8m0 hook", R: 4, M: 3, H: 640, E: 4, K: 2, fp8: true, round: true, ue8m0: true, hook: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := Shape{MaxTokens: c.M, Hidden: c.H, NumExperts: c.E}
			g := newGroup(t, c.R, s, false, 10*time.Second)
			tokens := c.tokens
			if tokens == nil {
				tokens = make([]int, c.R)
				for r := range tokens {
					tokens[r] = c.M
				}
			}
			rng := rand.New(rand.NewPCG(1, uint64(c.R)))
			L, RM, H := c.E/c.R, c.R*c.M, c.H
			// Three rounds: both halves in turn, and the acknowledgements of call n-2.
			for round := range 3 {
				in := inputs(rng, c.R, c.K, s, tokens)
				args := make([]*DispatchArgs, c.R)
				errs := g.each(func(r int, e *Engine) error {
					args[r] = dispatchArgs(s, c.R, c.K, in[r], c.fp8, c.round, c.ue8m0)
					recv, err := e.Dispatch(args[r])
					if err != nil {
						return err
					}
					return recv.Finish()
				})
				for _, err := range errs {
					require.NoError(t, err)
				}
				for r, a := range args {
					for j := range L {
						want := expectRows(in, c.K, L, r*L+j)
						require.Equal(t, len(want), int(a.Count[j]), "round %d rank %d expert %d", round, r, j)
						assert.Equal(t, a.Count[j], a.CumStats[j])
						for i, w := range want {
							row := j*RM + i
							require.Equal(t, int32(w[1]), a.SrcInfo[row])
							x := in[w[0]].x[w[1]*H : (w[1]+1)*H]
							if !c.fp8 {
								assert.Equal(t, x, unsafe.Slice((*uint16)(unsafe.Pointer(&a.RecvX[row*2*H])), H))
								continue
							}
							q, sc := make([]byte, H), make([]float32, H/ScaleBlock)
							castFP8(x, q, sc, c.round)
							assert.Equal(t, q, a.RecvX[row*H:(row+1)*H])
							for b, v := range sc {
								if c.ue8m0 {
									word := a.RecvScales[(j*((H/ScaleBlock+3)/4)+b/4)*RM+i]
									assert.Equal(t, ue8m0(v), uint8(word>>(8*(b%4))))
								} else {
									assert.Equal(t, v, *(*float32)(unsafe.Pointer(&a.RecvScales[(j*(H/ScaleBlock)+b)*RM+i])))
								}
							}
						}
						begin := 0
						for src := range c.R {
							n := 0
							for _, w := range want {
								if w[0] == src {
									n++
								}
							}
							assert.Equal(t, int64(begin)<<32|int64(n), a.LayoutRange[j*c.R+src])
							begin += n
						}
					}
				}
				// Combine the received rows as they came (bf16 only: fp8 rows are bytes here).
				if c.fp8 {
					continue
				}
				outs := make([][]uint16, c.R)
				errs = g.each(func(r int, e *Engine) error {
					a := args[r]
					outs[r] = make([]uint16, in[r].T*H)
					recv, err := e.Combine(&CombineArgs{Shape: s, NumTokens: in[r].T, NumTopk: c.K,
						X: unsafe.Slice((*uint16)(unsafe.Pointer(&a.RecvX[0])), L*RM*H), SrcInfo: a.SrcInfo, LayoutRange: a.LayoutRange,
						TopkIdx: in[r].topk, TopkWeights: in[r].w, Out: outs[r], WaitStats: make([]int64, c.R)})
					if err != nil {
						return err
					}
					if c.hook {
						time.Sleep(time.Millisecond)
					}
					return recv.Finish()
				})
				for _, err := range errs {
					require.NoError(t, err)
				}
				for r := range c.R {
					want := refCombine(in[r], c.K, L, H, nil, identity)
					for tok := range in[r].T {
						for ch := range H {
							require.Equal(t, want[tok*H+ch], outs[r][tok*H+ch], "rank %d token %d channel %d", r, tok, ch)
						}
					}
				}
			}
		})
	}
}

func TestTwoCallsAwaitTheirHooks(t *testing.T) {
	s := Shape{MaxTokens: 2, Hidden: 128, NumExperts: 2}
	g := newGroup(t, 2, s, false, 5*time.Second)
	rng := rand.New(rand.NewPCG(2, 2))
	in1, in2 := inputs(rng, 2, 1, s, []int{2, 2}), inputs(rng, 2, 1, s, []int{2, 2})
	errs := g.each(func(r int, e *Engine) error {
		a1, a2 := dispatchArgs(s, 2, 1, in1[r], false, false, false), dispatchArgs(s, 2, 1, in2[r], false, false, false)
		h1, err := e.Dispatch(a1)
		require.NoError(t, err)
		h2, err := e.Dispatch(a2)
		require.NoError(t, err)
		// A third call would overwrite the rows that the first hook has not read.
		_, err = e.Dispatch(a1)
		require.ErrorIs(t, err, ErrInvalid)
		require.ErrorContains(t, err, "receive hook of low-latency call 1")
		require.NoError(t, h1.Finish())
		require.ErrorContains(t, h1.Finish(), "already called")
		require.NoError(t, h2.Finish())
		assert.Equal(t, int32(len(expectRows(in1, 1, 1, r))), a1.Count[0])
		assert.Equal(t, int32(len(expectRows(in2, 1, 1, r))), a2.Count[0])
		return nil
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
}

func TestTimeoutMasksOrFails(t *testing.T) {
	s := Shape{MaxTokens: 2, Hidden: 128, NumExperts: 4}
	for _, shrink := range []bool{true, false} {
		g := newGroup(t, 2, s, shrink, 200*time.Millisecond)
		in := inputs(rand.New(rand.NewPCG(3, 3)), 2, 2, s, []int{2, 2})
		// Rank 1 never calls.
		a := dispatchArgs(s, 2, 2, in[0], false, false, false)
		recv, err := g.engines[0].Dispatch(a)
		require.NoError(t, err)
		err = recv.Finish()
		if shrink {
			require.NoError(t, err)
			assert.Equal(t, []int{1}, g.engines[0].TimedOut())
			assert.True(t, g.engines[0].Masked(1))
			assert.Equal(t, int64(0), a.LayoutRange[1]&0xffffffff)
			continue
		}
		require.ErrorIs(t, err, ErrTimeout)
		require.ErrorContains(t, err, "rank 1 did not answer")
		_, err = g.engines[0].Dispatch(a)
		require.ErrorContains(t, err, "needs clean_low_latency_buffer")
		// A clean on both ranks brings the group back.
		for _, err := range g.each(func(r int, e *Engine) error { return e.Clean(s) }) {
			require.NoError(t, err)
		}
		for _, err := range g.each(func(r int, e *Engine) error {
			recv, err := e.Dispatch(dispatchArgs(s, 2, 2, in[r], false, false, false))
			if err == nil {
				err = recv.Finish()
			}
			return err
		}) {
			require.NoError(t, err)
		}
	}
}

func TestMaskedRankIsNeitherSentToNorAwaited(t *testing.T) {
	s := Shape{MaxTokens: 3, Hidden: 128, NumExperts: 6}
	g := newGroup(t, 3, s, true, 10*time.Second)
	in := inputs(rand.New(rand.NewPCG(4, 4)), 3, 3, s, []int{3, 3, 3})
	for r := range 2 {
		require.NoError(t, g.engines[r].SetMask(2, true))
	}
	outs := make([][]uint16, 3)
	errs := g.each(func(r int, e *Engine) error {
		if r == 2 {
			return nil
		}
		a := dispatchArgs(s, 3, 3, in[r], false, false, false)
		recv, err := e.Dispatch(a)
		if err == nil {
			err = recv.Finish()
		}
		if err != nil {
			return err
		}
		assert.Equal(t, int64(0), a.LayoutRange[2]&0xffffffff)
		outs[r] = make([]uint16, in[r].T*s.Hidden)
		recv, err = e.Combine(&CombineArgs{Shape: s, NumTokens: in[r].T, NumTopk: 3,
			X: unsafe.Slice((*uint16)(unsafe.Pointer(&a.RecvX[0])), len(a.RecvX)/2), SrcInfo: a.SrcInfo,
			LayoutRange: a.LayoutRange, TopkIdx: in[r].topk, TopkWeights: in[r].w, Out: outs[r]})
		if err == nil {
			err = recv.Finish()
		}
		return err
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
	for r := range 2 {
		assert.Equal(t, refCombine(in[r], 3, 2, s.Hidden, []bool{false, false, true}, identity), outs[r], "rank %d", r)
	}
	// Nothing reached rank 2's region.
	l, _ := NewLayout(3, s)
	assert.False(t, slices.ContainsFunc(unsafe.Slice((*byte)(g.engines[2].d.Regions[2]), l.TotalBytes),
		func(b byte) bool { return b != 0 }))
	mask := make([]int32, 3)
	g.engines[0].Masks(mask)
	assert.Equal(t, []int32{0, 0, 1}, mask)
	g.engines[0].CleanMasks()
	g.engines[0].Masks(mask)
	assert.Equal(t, []int32{0, 0, 0}, mask)
	assert.ErrorIs(t, g.engines[0].SetMask(3, true), ErrInvalid)
}

func TestDuplicateExpertIsRefused(t *testing.T) {
	s := Shape{MaxTokens: 2, Hidden: 128, NumExperts: 2}
	g := newGroup(t, 1, s, false, time.Second)
	in := rankInput{T: 1, x: make([]uint16, 128), topk: []int64{1, -1, 1}}
	_, err := g.engines[0].Dispatch(dispatchArgs(s, 1, 3, in, false, false, false))
	require.ErrorIs(t, err, ErrInvalid)
	assert.ErrorContains(t, err, "topk_idx[0, 2] = 1: expert 1 is selected twice by token 0")
	in.topk[2] = 2
	_, err = g.engines[0].Dispatch(dispatchArgs(s, 1, 3, in, false, false, false))
	assert.ErrorContains(t, err, "topk_idx[0, 2] = 2: expected -1 or an expert in [0, 2)")
}

func TestShapeChangeNeedsClean(t *testing.T) {
	s := Shape{MaxTokens: 2, Hidden: 128, NumExperts: 2}
	g := newGroup(t, 1, s, false, time.Second)
	in := inputs(rand.New(rand.NewPCG(5, 5)), 1, 1, s, []int{1})
	recv, err := g.engines[0].Dispatch(dispatchArgs(s, 1, 1, in[0], false, false, false))
	require.NoError(t, err)
	require.NoError(t, recv.Finish())
	small := Shape{MaxTokens: 1, Hidden: 128, NumExperts: 2}
	_, err = g.engines[0].Dispatch(dispatchArgs(small, 1, 1, in[0], false, false, false))
	require.ErrorContains(t, err, "call clean_low_latency_buffer")
	require.NoError(t, g.engines[0].Clean(small))
	recv, err = g.engines[0].Dispatch(dispatchArgs(small, 1, 1, in[0], false, false, false))
	require.NoError(t, err)
	require.NoError(t, recv.Finish())
	big := Shape{MaxTokens: 1000, Hidden: 128, NumExperts: 2}
	require.ErrorContains(t, g.engines[0].Clean(big), "see Buffer.get_low_latency_rdma_size_hint")
}

// combineRound dispatches in's tokens (bf16), lets expert make each expert's rows and combines
// them with comb's selections and weights (in's, or with selections repeated), on every rank.
func combineRound(t *testing.T, g *group, s Shape, K int, in, comb []rankInput, expert func(g int, x []uint16) []uint16) [][]uint16 {
	t.Helper()
	return combineCalls(t, g, s, K, in, comb, expert, false)
}

// combineCalls runs a dispatch and a combine on every rank; with sendsInTurn the combines' send
// phases run one rank after another, rank 0 first, and only then their receives, as hooks would.
func combineCalls(t *testing.T, g *group, s Shape, K int, in, comb []rankInput, expert func(g int, x []uint16) []uint16,
	sendsInTurn bool) [][]uint16 {
	t.Helper()
	R := len(g.engines)
	L, RM, H := s.NumExperts/R, R*s.MaxTokens, s.Hidden
	outs := make([][]uint16, R)
	args := make([]*CombineArgs, R)
	recvs := make([]*Recv, R)
	send := func(r int, e *Engine) error {
		var err error
		recvs[r], err = e.Combine(args[r])
		return err
	}
	errs := g.each(func(r int, e *Engine) error {
		a := dispatchArgs(s, R, K, in[r], false, false, false)
		recv, err := e.Dispatch(a)
		if err == nil {
			err = recv.Finish()
		}
		if err != nil {
			return err
		}
		rows := unsafe.Slice((*uint16)(unsafe.Pointer(&a.RecvX[0])), L*RM*H)
		x := make([]uint16, L*RM*H)
		for j := range L {
			for i := range RM {
				copy(x[(j*RM+i)*H:], expert(r*L+j, rows[(j*RM+i)*H:(j*RM+i+1)*H]))
			}
		}
		outs[r] = make([]uint16, in[r].T*H)
		args[r] = &CombineArgs{Shape: s, NumTokens: in[r].T, NumTopk: K, X: x, SrcInfo: a.SrcInfo,
			LayoutRange: a.LayoutRange, TopkIdx: comb[r].topk, TopkWeights: comb[r].w, Out: outs[r]}
		if sendsInTurn {
			return nil
		}
		if err := send(r, e); err != nil {
			return err
		}
		return recvs[r].Finish()
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
	if sendsInTurn {
		for r, e := range g.engines {
			require.NoError(t, send(r, e), "rank %d's send, its peers' not called yet", r)
		}
		for _, err := range g.each(func(r int, e *Engine) error { return recvs[r].Finish() }) {
			require.NoError(t, err)
		}
	}
	return outs
}

// A token that selects several experts of one rank gets one row from that rank, the rank's
// partial sum rounded to bf16; a rank with one of its experts sends the row as it is.
func TestCombineByRank(t *testing.T) {
	const R, K, M, H = 3, 5, 4, 256
	s := Shape{MaxTokens: M, Hidden: H, NumExperts: 6} // L = 2: experts 2r and 2r+1 on rank r
	g := newGroup(t, R, s, false, 10*time.Second)
	rng := rand.New(rand.NewPCG(6, 6))
	in := inputs(rng, R, K, s, []int{M, M, M})
	copy(in[0].topk, []int64{
		0, 4, 1, -1, 2, // rank 0 twice (k 0, 2), then rank 2, rank 1 once each
		5, 3, 4, 2, -1, // ranks 2 and 1 twice each
		-1, -1, -1, -1, -1, // nothing
		1, -1, 5, 0, 3, // rank 0 twice, ranks 2 and 1 once
	})
	oldSum := func(r int, out []uint16) bool { // whether out differs from the sum over k of every row
		for tok := range in[r].T {
			for c := range H {
				acc := float32(0)
				for k := range K {
					if e := in[r].topk[tok*K+k]; e >= 0 {
						acc += float32(bf16ToF32(scaled(int(e), in[r].x[tok*H:(tok+1)*H])[c]) * in[r].w[tok*K+k])
					}
				}
				if f32ToBF16(acc) != out[tok*H+c] {
					return true
				}
			}
		}
		return false
	}
	outs := combineRound(t, g, s, K, in, in, scaled)
	for r := range R {
		assert.Equal(t, refCombine(in[r], K, 2, H, nil, scaled), outs[r], "rank %d", r)
	}
	assert.True(t, oldSum(0, outs[0]), "the partial sums' rounding shows")

	// The combine may select an expert twice (the dispatch may not): two selections of one row.
	in[0].topk[10] = 3 // token 2: expert 3
	comb := slices.Clone(in)
	comb[0].topk = slices.Clone(in[0].topk)
	comb[0].topk[3] = 0  // token 0: expert 0 at k 0 and 3
	comb[0].topk[13] = 3 // token 2: expert 3 at k 0 and 3, its only rank
	comb[0].topk[16] = 1 // token 3: expert 1 at k 0 and 1
	outs = combineRound(t, g, s, K, in, comb, scaled)
	for r := range R {
		assert.Equal(t, refCombine(comb[r], K, 2, H, nil, scaled), outs[r], "rank %d", r)
	}

	// A clean zeroes the push flags too: the next combine with the same seq does not read stale
	// selections.
	for _, err := range g.each(func(r int, e *Engine) error { return e.Clean(s) }) {
		require.NoError(t, err)
	}
	l, _ := NewLayout(R, s)
	for r, e := range g.engines {
		for h := range 2 {
			for p := range R {
				assert.Zero(t, e.word(r, l.PushFlag(h, p)).Load(), "rank %d half %d push flag of %d", r, h, p)
			}
		}
	}
	in = inputs(rng, R, K, s, []int{M, 2, 0})
	outs = combineRound(t, g, s, K, in, in, scaled)
	for r := range R {
		assert.Equal(t, refCombine(in[r], K, 2, H, nil, scaled), outs[r], "rank %d", r)
	}
}

// The combine's send phase waits for no peer's selections: its receive sends the rows of the
// peers whose selections came late, first waiting for them; a peer that does not call is masked
// (shrink) or named.
func TestCombineWaitsForTheTopk(t *testing.T) {
	s := Shape{MaxTokens: 2, Hidden: 128, NumExperts: 4}
	for _, shrink := range []bool{true, false} {
		g := newGroup(t, 2, s, shrink, 200*time.Millisecond)
		a := &CombineArgs{Shape: s, NumTokens: 1, NumTopk: 2, X: make([]uint16, 2*4*128), SrcInfo: make([]int32, 2*4),
			LayoutRange: make([]int64, 2*2), TopkIdx: []int64{0, 3}, TopkWeights: []float32{1, 1}, Out: make([]uint16, 128)}
		recv, err := g.engines[0].Combine(a)
		require.NoError(t, err)
		err = recv.Finish()
		if !shrink {
			require.ErrorIs(t, err, ErrTimeout)
			assert.ErrorContains(t, err, "waiting for rank 1's top-k (call 1)")
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, []int{1}, g.engines[0].TimedOut())
		assert.Equal(t, make([]uint16, 128), a.Out) // expert 0 had no row for the token
	}
}

// Send phases that run one rank after another (hooked sends, each returning before the next
// rank's begins) and receives after them give the same sums.
func TestCombineSendsInTurn(t *testing.T) {
	const R, K, M, H = 3, 5, 4, 128
	s := Shape{MaxTokens: M, Hidden: H, NumExperts: 6}
	g := newGroup(t, R, s, false, 5*time.Second)
	rng := rand.New(rand.NewPCG(7, 8))
	in := inputs(rng, R, K, s, []int{M, 3, M})
	outs := combineCalls(t, g, s, K, in, in, scaled, true)
	for r := range R {
		assert.Equal(t, refCombine(in[r], K, 2, H, nil, scaled), outs[r], "rank %d", r)
	}
}
