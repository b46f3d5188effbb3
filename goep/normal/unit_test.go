package normal

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string // "" = valid
	}{
		{Config{NumSMs: 24, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256}, ""},
		{Config{NumSMs: 2, NumMaxNVLChunkedSendTokens: 1, NumMaxNVLChunkedRecvTokens: 2}, ""},
		{Config{NumSMs: 0, NumMaxNVLChunkedSendTokens: 1, NumMaxNVLChunkedRecvTokens: 2}, "num_sms = 0"},
		{Config{NumSMs: 3, NumMaxNVLChunkedSendTokens: 1, NumMaxNVLChunkedRecvTokens: 2}, "num_sms = 3"},
		{Config{NumSMs: 2, NumMaxNVLChunkedSendTokens: 0, NumMaxNVLChunkedRecvTokens: 2}, "0 < num_max_nvl_chunked_send_tokens (0)"},
		{Config{NumSMs: 2, NumMaxNVLChunkedSendTokens: 2, NumMaxNVLChunkedRecvTokens: 2}, "< num_max_nvl_chunked_recv_tokens (2)"},
	} {
		err := tc.cfg.Validate()
		if tc.want == "" {
			assert.NoError(t, err, "%v", tc.cfg)
		} else if assert.Error(t, err, "%v", tc.cfg) {
			assert.Contains(t, err.Error(), tc.want)
			assert.ErrorIs(t, err, ErrInvalid)
		}
	}
}

func TestChannelRange(t *testing.T) {
	for _, tc := range []struct{ T, C int }{{0, 3}, {1, 3}, {10, 3}, {9, 3}, {4096, 12}, {5, 8}} {
		next := 0
		for c := 0; c < tc.C; c++ {
			lo, hi := channelRange(tc.T, tc.C, c)
			assert.Equal(t, next, lo, "%+v channel %d", tc, c)
			assert.LessOrEqual(t, lo, hi)
			assert.LessOrEqual(t, hi-lo, (tc.T+tc.C-1)/tc.C)
			next = hi
		}
		assert.Equal(t, tc.T, next, "%+v", tc)
	}
}

// The rings must always fit in what DeepEP's size hint allocates.
func TestSizesFitHint(t *testing.T) {
	for _, cfg := range []Config{
		{NumSMs: 2, NumMaxNVLChunkedSendTokens: 1, NumMaxNVLChunkedRecvTokens: 2},
		{NumSMs: 20, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256},
		{NumSMs: 24, NumMaxNVLChunkedSendTokens: 8, NumMaxNVLChunkedRecvTokens: 288},
		{NumSMs: 132, NumMaxNVLChunkedSendTokens: 4, NumMaxNVLChunkedRecvTokens: 7},
	} {
		for _, R := range []int{1, 2, 3, 4, 8} {
			for _, hb := range []int{1, 7, 2880 * 2, 7168, 7168 * 2, 7168 * 4} {
				hint := NVLBufferSizeHint(cfg, hb, R)
				assert.Zero(t, hint%128)
				assert.LessOrEqual(t, DispatchBufferBytes(cfg, R, hb, 512, 128), hint, "%v R=%d hidden_bytes=%d", cfg, R, hb)
				assert.LessOrEqual(t, CombineBufferBytes(cfg, R, hb, 128), hint, "%v R=%d hidden_bytes=%d", cfg, R, hb)
				assert.LessOrEqual(t, NotifyBufferBytes(R, cfg.NumChannels(), 256*R), hint, "%v R=%d", cfg, R)
			}
		}
	}
	// DeepEP's formula, spelled out once.
	cfg := Config{NumSMs: 24, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256}
	c, r, recv, hb := int64(12), int64(8), int64(256), int64(7168*2)
	want := c*r*5*4 + c*r*recv*hb + c*r*recv*8 + c*r*recv*128*8 + c*r*recv*128*4 + c*r*recv*128*4
	assert.Equal(t, (want+127)/128*128, NVLBufferSizeHint(cfg, int(hb), 8))
}

func TestLayout(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct{ T, K, E, R int }{{0, 4, 8, 2}, {1, 1, 1, 1}, {50, 8, 64, 8}, {33, 9, 12, 3}, {17, 2, 6, 3}} {
		sc := scenario{R: tc.R, E: tc.E, K: tc.K, noRecvRank: -1, tokens: make([]int, tc.R)}
		sc.tokens[0] = tc.T
		in := makeInputs(rng, &sc)
		ref := reference(&sc, in)
		perRank, perExpert, inRank := make([]int32, tc.R), make([]int32, tc.E), make([]bool, tc.T*tc.R)
		for i := range inRank {
			inRank[i] = true // must be overwritten
		}
		require.NoError(t, Layout(in[0].topk, tc.T, tc.K, tc.E, tc.R, perRank, perExpert, inRank))
		assert.Equal(t, ref[0].perRank, perRank, "%+v", tc)
		assert.Equal(t, ref[0].perExpert, perExpert, "%+v", tc)
		assert.Equal(t, ref[0].inRank, inRank, "%+v", tc)
	}
}

func TestLayoutErrors(t *testing.T) {
	topk := []int64{0, 1, -1, 7, 3, 2}
	for _, tc := range []struct {
		name             string
		topk             []int64
		T, K, E, R       int
		nRank, nExp, nIn int
		want             string
	}{
		{"out of range", []int64{0, 1, -1, 300, 3, 2}, 3, 2, 256, 8, 8, 256, 24, "topk_idx[1,1] = 300 is out of range [0, 256)"},
		{"negative", []int64{0, 1, -2, 7, 3, 2}, 3, 2, 8, 2, 2, 8, 6, "topk_idx[1,0] = -2 is out of range"},
		{"experts not divisible", topk, 3, 2, 8, 3, 3, 8, 9, "num_experts = 8 must be a positive multiple of num_ranks = 3"},
		{"short topk", topk[:5], 3, 2, 8, 2, 2, 8, 6, "topk_idx has 5 elements, want 6"},
		{"short per rank", topk, 3, 2, 8, 2, 1, 8, 6, "num_tokens_per_rank has 1 elements, want 2"},
		{"short per expert", topk, 3, 2, 8, 2, 2, 7, 6, "num_tokens_per_expert has 7 elements, want 8"},
		{"short in rank", topk, 3, 2, 8, 2, 2, 8, 5, "is_token_in_rank has 5 elements, want 6"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Layout(tc.topk, tc.T, tc.K, tc.E, tc.R, make([]int32, tc.nRank), make([]int32, tc.nExp), make([]bool, tc.nIn))
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrInvalid)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestDomainErrors(t *testing.T) {
	s := newSim(t, 2, 1024, time.Second)
	good := *s.doms[0]
	for _, tc := range []struct {
		name string
		mod  func(d *Domain)
		want string
	}{
		{"rank out of range", func(d *Domain) { d.Rank = 2 }, "rank = 2 is out of range [0, 2)"},
		{"too many ranks", func(d *Domain) { d.NumRanks = 9 }, "num_ranks = 9"},
		{"missing regions", func(d *Domain) { d.Buffers = d.Buffers[:1] }, "1 data and 2 control regions"},
		{"nil control", func(d *Domain) { d.Controls = []unsafe.Pointer{d.Controls[0], nil} }, "control region of rank 1"},
		{"misaligned data", func(d *Domain) {
			d.Buffers = []unsafe.Pointer{d.Buffers[0], unsafe.Add(d.Buffers[1], 4)}
		}, "data region of rank 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := good
			tc.mod(&d)
			err := Barrier(&d, "")
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrInvalid)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	assert.ErrorIs(t, Barrier(nil, ""), ErrInvalid)
	requireNoErrors(t, s.each(func(r int, d *Domain) error { return Barrier(d, "") }))
}

// Argument errors are reported with the argument's name, and the call
// still leaves the domain usable.
func TestArgumentErrors(t *testing.T) {
	s := protoSim(t, 1, time.Second)
	p := prepare(t, s, 30)
	for _, tc := range []struct {
		name string
		run  func(d *Domain) error
		want string
	}{
		{"dispatch x", func(d *Domain) error { a := p.cachedArgs(0); a.X = a.X[1:]; return Dispatch(d, a) }, "x has"},
		{"dispatch recv_x", func(d *Domain) error { a := p.cachedArgs(0); a.RecvX = nil; return Dispatch(d, a) }, "recv_x has 0 elements"},
		{"dispatch scales", func(d *Domain) error { a := p.cachedArgs(0); a.XScales = nil; return Dispatch(d, a) }, "x_scales has 0 elements"},
		{"dispatch rank prefix", func(d *Domain) error {
			a := p.cachedArgs(0)
			a.RankPrefixMatrix = []int32{-1}
			return Dispatch(d, a)
		}, "rank_prefix_matrix[0,0] = -1 is not cumulative"},
		{"dispatch channel prefix", func(d *Domain) error {
			a := p.cachedArgs(0)
			a.ChannelPrefixMatrix = []int32{0, 1}
			return Dispatch(d, a)
		}, "channel_prefix_matrix[0,0] = 0 but is_token_in_rank gives"},
		{"dispatch worst", func(d *Domain) error { a := p.cachedArgs(0); a.NumWorstTokens = 3; return Dispatch(d, a) }, "num_worst_tokens = 3 is too small"},
		{"dispatch config", func(d *Domain) error { a := p.cachedArgs(0); a.Config.NumSMs = 3; return Dispatch(d, a) }, "num_sms = 3"},
		{"combine dtype", func(d *Domain) error { a := p.combineArgs(0); a.DType = 9; return Combine(d, a) }, "unsupported dtype"},
		{"combine send_head", func(d *Domain) error {
			a := p.combineArgs(0)
			a.SendHead = append([]int32(nil), a.SendHead...)
			a.SendHead[0] = 5
			return Combine(d, a)
		}, "send_head[0,0] = 5, want 0 or -1"},
		{"combine bias", func(d *Domain) error { a := p.combineArgs(0); a.Bias0 = make([]byte, 3); return Combine(d, a) }, "bias_0 has 3 elements"},
		{"combine misaligned", func(d *Domain) error {
			a := p.combineArgs(0)
			b := alignedBytes(len(a.CombinedX) + 1)
			a.CombinedX = b[1:]
			return Combine(d, a)
		}, "combined_x is not aligned"},
		{"notify per rank", func(d *Domain) error {
			sc, o := &p.sc, &p.out[0]
			_, err := Notify(d, &NotifyArgs{Config: sc.cfg, NumTokens: p.in[0].T, NumExperts: sc.E, ExpertAlignment: 1,
				NumTokensPerRank: []int32{o.perRank[0] + 1}, NumTokensPerExpert: o.perExpert, IsTokenInRank: o.inRank,
				RankPrefixMatrix: make([]int32, 1), ChannelPrefixMatrix: make([]int32, 2),
				RecvChannelPrefixMatrix: make([]int32, 2), NumRecvTokensPerExpert: make([]int32, sc.E)})
			return err
		}, "num_tokens_per_rank[0] ="},
		{"notify alignment", func(d *Domain) error {
			_, err := Notify(d, &NotifyArgs{Config: p.sc.cfg, NumExperts: 4, ExpertAlignment: 0})
			return err
		}, "expert_alignment = 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run(s.doms[0])
			require.Error(t, err)
			assert.True(t, errors.Is(err, ErrInvalid), "%v", err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	goodRound(t, s, 31)
}

func TestBF16(t *testing.T) {
	for _, tc := range []struct {
		in   float32
		want uint16
	}{
		{0, 0}, {1, 0x3f80}, {-2, 0xc000},
		{math.Float32frombits(0x3f808000), 0x3f80}, // tie -> even (down)
		{math.Float32frombits(0x3f818000), 0x3f82}, // tie -> even (up)
		{math.Float32frombits(0x3f808001), 0x3f81}, // above tie
		{float32(math.Inf(1)), 0x7f80},
		{math.MaxFloat32, 0x7f80}, // rounds up to infinity
	} {
		assert.Equal(t, tc.want, F32ToBF16(tc.in), "%v", tc.in)
	}
	assert.True(t, math.IsNaN(float64(BF16ToF32(F32ToBF16(float32(math.NaN()))))))
	for h := 0; h < 1<<16; h++ {
		f := BF16ToF32(uint16(h))
		if !math.IsNaN(float64(f)) {
			require.Equal(t, uint16(h), F32ToBF16(f), "%#x", h)
		}
	}
}

func TestF16(t *testing.T) {
	// Every half survives the round trip, and every float32 rounds to the
	// nearest half (ties to even), checked against neighbours in float64.
	for h := 0; h < 1<<16; h++ {
		f := F16ToF32(uint16(h))
		if math.IsNaN(float64(f)) {
			require.True(t, math.IsNaN(float64(F16ToF32(F32ToF16(f)))))
			continue
		}
		require.Equal(t, uint16(h), F32ToF16(f), "%#x", h)
	}
	assert.Equal(t, float32(65504), F16ToF32(0x7bff))
	assert.Equal(t, float32(math.Ldexp(1, -24)), F16ToF32(1))
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 200000; i++ {
		f := math.Float32frombits(rng.Uint32())
		if math.IsNaN(float64(f)) {
			continue
		}
		if i%2 == 0 { // concentrate on the half range, subnormals included
			f = float32(math.Ldexp(rng.Float64()*2-1, rng.IntN(45)-26))
		}
		got := F32ToF16(f)
		g := float64(F16ToF32(got))
		// No other half is closer; on a tie the chosen one is even.
		for _, n := range []uint16{got - 1, got + 1} {
			if n&0x7c00 == 0x7c00 && n&0x3ff != 0 {
				continue
			}
			if (n^got)&0x8000 != 0 {
				continue
			}
			nv := float64(F16ToF32(n))
			d, nd := math.Abs(g-float64(f)), math.Abs(nv-float64(f))
			if math.IsInf(g, 0) {
				require.GreaterOrEqual(t, math.Abs(float64(f)), 65520.0, "%v -> %#x", f, got)
				continue
			}
			require.True(t, d < nd || (d == nd && got&1 == 0), "%v -> %#x (%v), neighbour %#x (%v)", f, got, g, n, nv)
		}
	}
}
