//go:build cgo

package cudanormal

import (
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
	cudall "github.com/pyep/pyep/goep/cuda/lowlatency"
)

// The host path of every call kind on the cuda backend, from goep.Buffer's API to the last
// launch, over the fake driver: kernels that do nothing but answer the host (notify writes its
// result), so each benchmark is the Go core's own time and allocations per call (the checks, the
// engine's bookkeeping, the stream order, the launches' parameter copies), without the driver's.
// One rank, the reference shape: 4096 tokens, hidden 7168, top-8 of 256 experts; low latency 128
// tokens of hidden 7168, top-8 of 288 experts.
//
//	go test -run '^$' -bench HostPath -benchmem ./goep/cuda/normal/

// hostLoader is a cuda.KernelLoader of kernels that only answer the host.
type hostLoader struct{}

func (hostLoader) Load(b *cuda.Backend, file, kernel string, defines map[string]string) (driver.Function, error) {
	d := b.Driver().(*fake.Driver)
	name := "host:" + kernel
	d.World().RegisterKernel(name, func(l *fake.Launch) error {
		if kernel != "pyep_notify" {
			return nil
		}
		// Every rank's rows fit: notify lets the queued dispatch run, and answers with T rows.
		p := (*notifyParams)(l.Args[0])
		mem, err := l.Mem(driver.DevicePtr(p.result), notifyResultBytes)
		if err != nil {
			return err
		}
		res := (*notifyResult)(unsafe.Pointer(&mem[0]))
		res.num_recv, res.status, res._go = p.num_tokens, 0, 1
		atomic.StoreUint64(notifyTag(res), uint64(p.ctx.seq))
		return nil
	})
	mod, err := d.ModuleLoadData([]byte{1})
	if err != nil {
		return driver.Function{}, err
	}
	return mod.Function(name)
}

type hostLinks struct{}

func (hostLinks) NVLinkP2P(a, b string) (bool, string, error) { return true, "OK", nil }

// hostBench is one synced rank on a fake GPU, with its tensors in fake device memory.
type hostBench struct {
	buf       *goep.Buffer
	be        *cuda.Backend
	dev       int
	stream    uintptr
	allocated []driver.DevicePtr
}

const (
	hbT, hbH, hbK, hbE = 4096, 7168, 8, 256
	hbLLM, hbLLE       = 128, 288
)

func newHostBench(tb testing.TB) *hostBench {
	d := fake.New(fake.Config{MemBytes: 4 << 30})
	be, err := cuda.NewBackend(d, 0, cuda.BackendOptions{NVLink: hostLinks{}, Process: "rank0"})
	require.NoError(tb, err)
	be.SetNormalOptions(cuda.NormalOptions{Loader: hostLoader{}})
	rdma, err := goep.LowLatencySizeHint(hbLLM, hbH, 1, hbLLE)
	require.NoError(tb, err)
	buf, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 1, NumNVLBytes: 1 << 30, NumRDMABytes: rdma,
		LowLatencyMode: true, Engines: goep.Engines{Normal: NewEngine, LowLatency: cudall.NewEngine}}, be)
	require.NoError(tb, err)
	h, err := buf.LocalIPCHandle()
	require.NoError(tb, err)
	root, err := buf.LocalNVSHMEMUniqueID()
	require.NoError(tb, err)
	require.NoError(tb, buf.Sync([]int{0}, [][]byte{h}, root))
	s, err := d.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(tb, err)
	hb := &hostBench{buf: buf, be: be, dev: goep.DeviceCode(goep.CUDADevice, 0), stream: s.Raw()}
	tb.Cleanup(func() {
		exit, err := be.Enter()
		require.NoError(tb, err)
		for _, p := range hb.allocated {
			_ = d.MemFree(p)
		}
		_ = d.StreamDestroy(s)
		exit()
		require.NoError(tb, buf.Destroy())
		require.NoError(tb, be.Close())
	})
	return hb
}

// alloc is n bytes of device memory, 256-byte aligned as torch's.
func (h *hostBench) alloc(tb testing.TB, n int) uintptr {
	exit, err := h.be.Enter()
	defer exit()
	require.NoError(tb, err)
	p, err := h.be.Driver().MemAlloc(n)
	require.NoError(tb, err)
	h.allocated = append(h.allocated, p)
	return uintptr(p)
}

// desc describes a contiguous [s0, s1] tensor (s1 = 0: [s0]) of dtype index dt, in fresh memory.
func (h *hostBench) desc(tb testing.TB, dt int, s0, s1 int64, elem int) goep.Desc {
	if s1 == 0 {
		return goep.Desc{Data: h.alloc(tb, int(s0)*elem), DType: dt, Device: h.dev, NDim: 1, Size: [2]int64{s0}, Stride: [2]int64{1}}
	}
	return goep.Desc{Data: h.alloc(tb, int(s0*s1)*elem), DType: dt, Device: h.dev, NDim: 2, Size: [2]int64{s0, s1}, Stride: [2]int64{s1, 1}}
}

// The dtype indices of goep.DTypeNames.
const dtF32, dtBF16, dtI32, dtI64, dtBool, dtFP8 = 0, 3, 6, 7, 12, 13

// normalCase is a layout's outputs and a dispatch's arguments, handle and outputs.
type normalCase struct {
	cfg                                  goep.Config
	order                                goep.StreamOrder
	topk, weights, x, xFP8, scales       goep.Desc
	perRank, perExpert, inRank           goep.Desc
	rankPrefix, chanPrefix, recvChPrefix uintptr
	recvPerExpert, sendHead, counts      uintptr
	recv                                 goep.RecvTensors
	combined, combinedW                  uintptr
	countsMem                            []int32 // host memory that counts points at, kept alive
}

func (h *hostBench) normalCase(tb testing.TB) *normalCase {
	cfg, err := goep.NewConfig(24, 6, 256, 6, 128)
	require.NoError(tb, err)
	C := int64(cfg.NumChannels())
	c := &normalCase{cfg: cfg, order: goep.StreamOrder{Stream: h.stream, Flags: goep.OrderWait | goep.OrderJoin},
		topk: h.desc(tb, dtI64, hbT, hbK, 8), weights: h.desc(tb, dtF32, hbT, hbK, 4), x: h.desc(tb, dtBF16, hbT, hbH, 2),
		xFP8: h.desc(tb, dtFP8, hbT, hbH, 1), scales: h.desc(tb, dtF32, hbT, hbH/128, 4),
		perRank: h.desc(tb, dtI32, 1, 0, 4), perExpert: h.desc(tb, dtI32, hbE, 0, 4), inRank: h.desc(tb, dtBool, hbT, 1, 1),
		rankPrefix: h.alloc(tb, 4), chanPrefix: h.alloc(tb, int(4*C)), recvChPrefix: h.alloc(tb, int(4*C)),
		recvPerExpert: h.alloc(tb, 4*hbE), sendHead: h.alloc(tb, 4*hbT), combined: h.alloc(tb, 2*hbT*hbH),
		combinedW: h.alloc(tb, 4*hbT*hbK)}
	c.countsMem = make([]int32, hbE)
	c.counts = uintptr(unsafe.Pointer(&c.countsMem[0]))
	c.recv = goep.RecvTensors{Rows: hbT, X: h.alloc(tb, 2*hbT*hbH), XScales: h.alloc(tb, 4*hbT*hbH/128),
		SrcIdx: h.alloc(tb, 4*hbT), TopkIdx: h.alloc(tb, 8*hbT*hbK), TopkWeights: h.alloc(tb, 4*hbT*hbK)}
	return c
}

func (c *normalCase) dispatch(x, scales goep.Desc) *goep.DispatchArgs {
	return &goep.DispatchArgs{Config: c.cfg, ExpertAlignment: 1, X: x, XScales: scales, TopkIdx: c.topk,
		TopkWeights: c.weights, PerRank: c.perRank, PerExpert: c.perExpert, InRank: c.inRank, RankPrefix: c.rankPrefix,
		ChannelPrefix: c.chanPrefix, RecvChannelPrefix: c.recvChPrefix, RecvPerExpert: c.recvPerExpert,
		SendHead: c.sendHead, Counts: c.counts, Order: c.order}
}

var none = goep.Desc{NDim: goep.NoneDim}

// hostCall is one call kind of the host path.
type hostCall struct {
	name string
	call func() error
}

// hostCalls are the call kinds, each on the reference shape.
func (h *hostBench) hostCalls(tb testing.TB) []hostCall {
	c := h.normalCase(tb)
	calls := []hostCall{
		{"layout", func() error {
			return h.buf.Layout(&goep.LayoutArgs{TopkIdx: c.topk, NumExperts: hbE, PerRank: c.perRank.Data,
				PerExpert: c.perExpert.Data, InRank: c.inRank.Data, Order: c.order})
		}},
		{"dispatch_bf16", func() error {
			_, _, err := h.buf.DispatchQueued(c.dispatch(c.x, none), c.recv)
			return err
		}},
		{"dispatch_fp8", func() error {
			_, _, err := h.buf.DispatchQueued(c.dispatch(c.xFP8, c.scales), c.recv)
			return err
		}},
		{"dispatch_cached", func() error {
			return h.buf.DispatchCached(&goep.CachedDispatchArgs{Config: c.cfg, X: c.x, XScales: none, NumTokens: hbT,
				NumChannels: c.cfg.NumChannels(), NumRecv: hbT, RankPrefix: c.rankPrefix, ChannelPrefix: c.chanPrefix,
				InRank: c.inRank.Data, RecvX: c.recv.X, Order: c.order})
		}},
		{"combine", func() error {
			return h.buf.Combine(&goep.CombineArgs{Config: c.cfg, X: goep.Desc{Data: c.recv.X, DType: dtBF16, Device: h.dev,
				NDim: 2, Size: [2]int64{hbT, hbH}, Stride: [2]int64{hbH, 1}}, TopkWeights: goep.Desc{Data: c.recv.TopkWeights,
				DType: dtF32, Device: h.dev, NDim: 2, Size: [2]int64{hbT, hbK}, Stride: [2]int64{hbK, 1}}, Bias0: none, Bias1: none,
				NumTokens: hbT, NumChannels: c.cfg.NumChannels(), NumRecv: hbT, SrcIdx: c.recv.SrcIdx, RankPrefix: c.rankPrefix,
				ChannelPrefix: c.recvChPrefix, SendHead: c.sendHead, CombinedX: c.combined, CombinedTopkWeights: c.combinedW,
				Order: c.order})
		}},
	}
	// Low latency: one rank, L = 288 local experts, R*M = 128 rows each.
	L, RM := hbLLE, hbLLM
	llX, llTopk, llW := h.alloc(tb, 2*hbLLM*hbH), h.alloc(tb, 8*hbLLM*hbK), h.alloc(tb, 4*hbLLM*hbK)
	recvX, recvS := h.alloc(tb, L*RM*hbH), h.alloc(tb, 4*L*RM*hbH/128)
	src, rng, count := h.alloc(tb, 4*L*RM), h.alloc(tb, 8*L), h.alloc(tb, 4*L)
	expertOut, out := h.alloc(tb, 2*L*RM*hbH), h.alloc(tb, 2*hbLLM*hbH)
	return append(calls, hostCall{"ll_dispatch", func() error {
		_, err := h.buf.LowLatencyDispatch(&goep.LLDispatchArgs{MaxTokens: hbLLM, Hidden: hbH, NumExperts: hbLLE,
			NumTokens: hbLLM, NumTopk: hbK, UseFP8: true, X: llX, TopkIdx: llTopk, RecvX: recvX, RecvScales: recvS,
			SrcInfo: src, LayoutRange: rng, Count: count, Stream: h.stream})
		return err
	}}, hostCall{"ll_combine", func() error {
		_, err := h.buf.LowLatencyCombine(&goep.LLCombineArgs{MaxTokens: hbLLM, Hidden: hbH, NumExperts: hbLLE,
			NumTokens: hbLLM, NumTopk: hbK, X: expertOut, TopkIdx: llTopk, TopkWeights: llW, SrcInfo: src,
			LayoutRange: rng, Out: out, Stream: h.stream})
		return err
	}})
}

func BenchmarkHostPath(b *testing.B) {
	h := newHostBench(b)
	for _, c := range h.hostCalls(b) {
		b.Run(c.name, func(b *testing.B) {
			require.NoError(b, c.call()) // compiles (registers) the kernels
			b.ReportAllocs()
			for b.Loop() {
				if err := c.call(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestHostPathDriverCalls pins the driver calls of each call kind once its kernels are loaded: on
// a GPU each costs microseconds (a launch about 4), the core's own work far less.
func TestHostPathDriverCalls(t *testing.T) {
	h := newHostBench(t)
	d := h.be.Driver().(*fake.Driver)
	ops := []string{"CtxSetCurrent", "LaunchKernel", "EventRecord", "StreamWaitEvent", "DeviceGetAttribute"}
	want := map[string][]int{ // per op above
		"layout":          {1, 1, 2, 2, 0},
		"dispatch_bf16":   {1, 2, 2, 2, 0},
		"dispatch_fp8":    {1, 2, 2, 2, 0},
		"dispatch_cached": {1, 2, 2, 2, 0},
		"combine":         {1, 2, 2, 2, 0},
		"ll_dispatch":     {1, 1, 0, 0, 0},
		"ll_combine":      {1, 1, 0, 0, 0},
	}
	for _, c := range h.hostCalls(t) {
		require.NoError(t, c.call())
		before := make([]int, len(ops))
		for i, op := range ops {
			before[i] = d.Calls(op)
		}
		require.NoError(t, c.call())
		got := make([]int, len(ops))
		for i, op := range ops {
			got[i] = d.Calls(op) - before[i]
		}
		t.Logf("%-16s %v: %v", c.name, ops, got)
		assert.Equal(t, want[c.name], got, c.name)
	}
}
