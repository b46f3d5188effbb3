package goep

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// gpuBackend is a Backend on GPU 0 that allocates nothing: enough for the argument checks.
type gpuBackend struct{ Backend }

func (gpuBackend) DeviceID() int { return 0 }

// BenchmarkDispatchChecks is the core's part of a dispatch before any engine work: the checks of
// its seven caller tensors and the views of its outputs (4096 tokens, hidden 7168, top-8 of 256
// experts, 4 ranks).
func BenchmarkDispatchChecks(b *testing.B) {
	topo, err := NewTopology(0, 4, false)
	require.NoError(b, err)
	buf := &Buffer{topo: topo, backend: gpuBackend{}}
	cfg, err := NewConfig(24, 6, 256, 6, 128)
	require.NoError(b, err)
	mem := make([]byte, 1<<20)
	p := uintptr(unsafe.Pointer(&mem[0]))
	dev := DeviceCode(CUDADevice, 0)
	two := func(dtype int, s0, s1 int64) Desc {
		return Desc{Data: p, DType: dtype, Device: dev, NDim: 2, Size: [2]int64{s0, s1}, Stride: [2]int64{s1, 1}}
	}
	one := func(dtype int, s0 int64) Desc {
		return Desc{Data: p, DType: dtype, Device: dev, NDim: 1, Size: [2]int64{s0}, Stride: [2]int64{1}}
	}
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
