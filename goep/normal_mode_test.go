package goep

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestScaleStrides(t *testing.T) {
	cases := []struct {
		name           string
		shape, strides []int64
		st, ss         int64
		err            string
	}{
		{name: "dense", shape: []int64{5, 3}, strides: []int64{3, 1}, st: 3, ss: 1},
		{name: "column-major", shape: []int64{5, 3}, strides: []int64{1, 5}, st: 1, ss: 5},
		{name: "TMA-padded column-major", shape: []int64{5, 3}, strides: []int64{1, 8}, st: 1, ss: 8},
		{name: "padded rows", shape: []int64{5, 3}, strides: []int64{4, 1}, st: 4, ss: 1},
		{name: "one token of column-major", shape: []int64{1, 3}, strides: []int64{1, 8}, st: 1, ss: 8},
		{name: "one scale, rows apart", shape: []int64{5, 1}, strides: []int64{2, 9}, st: 2, ss: 1},
		{name: "overlapping columns", shape: []int64{5, 3}, strides: []int64{1, 4}, err: "expected row-major (3, 1) or column-major (1, 5)"},
		{name: "both strided", shape: []int64{5, 3}, strides: []int64{2, 10}, err: "strides (2, 10) for shape [5, 3]"},
		{name: "broadcast", shape: []int64{5, 3}, strides: []int64{0, 1}, err: "x[1]: strides (0, 1)"},
		{name: "stride past int32", shape: []int64{5, 3}, strides: []int64{1, 1 << 31}, err: "up to 2147483647"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := Desc{NDim: 2, Size: [2]int64{c.shape[0], c.shape[1]}, Stride: [2]int64{c.strides[0], c.strides[1]}}
			st, ss, err := scaleStrides("x[1]", d)
			if c.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), c.err)
				assert.True(t, IsArgument(err))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, [2]int64{c.st, c.ss}, [2]int64{st, ss})
		})
	}
}

// gpuBackend is a Backend on GPU 0 that allocates nothing: enough for the argument checks.
type gpuBackend struct{ Backend }

func (gpuBackend) DeviceID() int { return 0 }

// BenchmarkDispatchChecks is the core's part of a dispatch before any engine work: the checks of
// its seven caller tensors and the views of its outputs (4096 tokens, hidden 7168, top-8 of 256
// experts, 4 ranks).
func BenchmarkDispatchChecks(b *testing.B) {
	f := newDispatchFixture(b, 1<<20)
	buf, cfg, p, two, one := f.buf, f.cfg, f.p, f.two, f.one
	const bf16, i32, i64, f32, boolean = 3, 6, 7, 0, 12
	a := &DispatchArgs{Config: cfg, ExpertAlignment: 1, X: two(bf16, 4096, 7168), XScales: Desc{NDim: NoneDim},
		TopkIdx: two(i64, 4096, 8), TopkWeights: two(f32, 4096, 8), PerRank: one(i32, 4), PerExpert: one(i32, 256),
		InRank: two(boolean, 4096, 4), RankPrefix: p, ChannelPrefix: p, RecvChannelPrefix: p, RecvPerExpert: p, SendHead: p}
	r := RecvTensors{Rows: 16384, X: p, SrcIdx: p, TopkIdx: p, TopkWeights: p}
	b.ReportAllocs()
	for b.Loop() {
		call, err := buf.checkDispatch(a)
		if err != nil {
			b.Fatal(err)
		}
		if err := withRecv(&call.ts, &call.d, r); err != nil {
			b.Fatal(err)
		}
	}
}

// The limits every engine shares are checked once, here, before any engine work.
func TestDispatchLimits(t *testing.T) {
	f := newDispatchFixture(t, 1<<16)
	buf, cfg, p, two, one := f.buf, f.cfg, f.p, f.two, f.one
	const bf16, i32, i64, f32, boolean = 3, 6, 7, 0, 12
	args := func() *DispatchArgs {
		return &DispatchArgs{Config: cfg, ExpertAlignment: 1, X: two(bf16, 8, 64), XScales: Desc{NDim: NoneDim},
			TopkIdx: two(i64, 8, 2), TopkWeights: two(f32, 8, 2), PerRank: one(i32, 4), PerExpert: one(i32, 8),
			InRank: two(boolean, 8, 4), RankPrefix: p, ChannelPrefix: p, RecvChannelPrefix: p, RecvPerExpert: p, SendHead: p}
	}
	for _, tt := range []struct {
		name string
		edit func(a *DispatchArgs)
		err  string
	}{
		{"alignment", func(a *DispatchArgs) { a.ExpertAlignment = 1<<20 + 1 }, "expert_alignment = 1048577: expected at most 1048576"},
		{"worst tokens", func(a *DispatchArgs) { a.NumWorstTokens = 1 << 31 }, "num_worst_tokens = 2147483648: expected at most 2147483646"},
		{"top-k", func(a *DispatchArgs) { a.TopkIdx, a.TopkWeights = two(i64, 8, 129), two(f32, 8, 129) },
			"topk_idx: 129 experts per token, expected at most 128"},
		{"experts", func(a *DispatchArgs) { a.PerExpert = one(i32, 6) }, "num_tokens_per_expert: 6 experts, expected a positive multiple of num_ranks = 4"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a := args()
			_, err := buf.checkDispatch(a)
			require.NoError(t, err)
			tt.edit(a)
			_, err = buf.checkDispatch(a)
			assert.True(t, IsArgument(err))
			assert.EqualError(t, err, tt.err)
		})
	}
}

// dispatchFixture is a 4-rank buffer on a GPU-like backend, a config, and descriptions of tensors
// (two- and one-dimensional, contiguous) over n bytes of host memory.
type dispatchFixture struct {
	buf *Buffer
	cfg Config
	p   uintptr
	mem []byte
	two func(dtype int, s0, s1 int64) Desc
	one func(dtype int, s0 int64) Desc
}

func newDispatchFixture(tb testing.TB, n int) *dispatchFixture {
	topo, err := NewTopology(0, 4, false)
	require.NoError(tb, err)
	cfg, err := NewConfig(24, 6, 256, 6, 128)
	require.NoError(tb, err)
	f := &dispatchFixture{buf: &Buffer{topo: topo, backend: gpuBackend{}}, cfg: cfg, mem: make([]byte, n)}
	f.p = uintptr(unsafe.Pointer(&f.mem[0]))
	dev := DeviceCode(CUDADevice, 0)
	f.two = func(dtype int, s0, s1 int64) Desc {
		return Desc{Data: f.p, DType: dtype, Device: dev, NDim: 2, Size: [2]int64{s0, s1}, Stride: [2]int64{s1, 1}}
	}
	f.one = func(dtype int, s0 int64) Desc {
		return Desc{Data: f.p, DType: dtype, Device: dev, NDim: 1, Size: [2]int64{s0}, Stride: [2]int64{1}}
	}
	return f
}
