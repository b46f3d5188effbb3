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
		var p *notifyParams
		switch kernel {
		case "pyep_notify":
			p = (*notifyParams)(l.Args[0])
		case "pyep_notify_dispatch":
			p = &(*notifyDispatchParams)(l.Args[0]).notify
		default:
			return nil
		}
		// Every rank's rows fit: notify lets the queued dispatch run, and answers with T rows.
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

func newHostBench(tb testing.TB) *hostBench { return newBench(tb, true) }

// newNormalBench is a hostBench for normal mode alone (normalCalls), in a quarter of the memory.
func newNormalBench(tb testing.TB) *hostBench { return newBench(tb, false) }

func newBench(tb testing.TB, lowLatency bool) *hostBench {
	d := fake.New(fake.Config{MemBytes: 4 << 30})
	be, err := cuda.NewBackend(d, 0, cuda.BackendOptions{NVLink: hostLinks{}, Process: "rank0"})
	require.NoError(tb, err)
	be.SetNormalOptions(cuda.NormalOptions{Loader: hostLoader{}})
	nvl, rdma := int64(1<<30), int64(0)
	if lowLatency {
		rdma, err = goep.LowLatencySizeHint(hbLLM, hbH, 1, hbLLE)
		require.NoError(tb, err)
	} else {
		nvl = 128 << 20 // the rings of the reference shape, and notify's scratch
	}
	buf, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 1, NumNVLBytes: nvl, NumRDMABytes: rdma,
		LowLatencyMode: lowLatency, Engines: goep.Engines{Normal: NewEngine, LowLatency: cudall.NewEngine}}, be)
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

// hostCalls are the call kinds, each on the reference shape, and the normal-mode case they
// share.
func (h *hostBench) hostCalls(tb testing.TB) ([]hostCall, *normalCase) {
	calls, c := h.normalCalls(tb)
	return append(calls, h.llCalls(tb)...), c
}

// normalCalls are the normal-mode call kinds and their case: each call reads c.order when made.
func (h *hostBench) normalCalls(tb testing.TB) ([]hostCall, *normalCase) {
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
	return calls, c
}

// llCalls are the low-latency call kinds.
func (h *hostBench) llCalls(tb testing.TB) []hostCall {
	// Low latency: one rank, L = 288 local experts, R*M = 128 rows each.
	L, RM := hbLLE, hbLLM
	llX, llTopk, llW := h.alloc(tb, 2*hbLLM*hbH), h.alloc(tb, 8*hbLLM*hbK), h.alloc(tb, 4*hbLLM*hbK)
	recvX, recvS := h.alloc(tb, L*RM*hbH), h.alloc(tb, 4*L*RM*hbH/128)
	src, rng, count := h.alloc(tb, 4*L*RM), h.alloc(tb, 8*L), h.alloc(tb, 4*L)
	expertOut, out := h.alloc(tb, 2*L*RM*hbH), h.alloc(tb, 2*hbLLM*hbH)
	return []hostCall{{"ll_dispatch", func() error {
		_, err := h.buf.LowLatencyDispatch(&goep.LLDispatchArgs{MaxTokens: hbLLM, Hidden: hbH, NumExperts: hbLLE,
			NumTokens: hbLLM, NumTopk: hbK, UseFP8: true, X: llX, TopkIdx: llTopk, RecvX: recvX, RecvScales: recvS,
			SrcInfo: src, LayoutRange: rng, Count: count, Stream: h.stream})
		return err
	}}, hostCall{"ll_combine", func() error {
		_, err := h.buf.LowLatencyCombine(&goep.LLCombineArgs{MaxTokens: hbLLM, Hidden: hbH, NumExperts: hbLLE,
			NumTokens: hbLLM, NumTopk: hbK, X: expertOut, TopkIdx: llTopk, TopkWeights: llW, SrcInfo: src,
			LayoutRange: rng, Out: out, Stream: h.stream})
		return err
	}}}
}

func BenchmarkHostPath(b *testing.B) {
	h := newHostBench(b)
	calls, _ := h.hostCalls(b)
	for _, c := range calls {
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

// driverOps are the driver calls TestHostPathDriverCalls counts.
var driverOps = []string{"CtxSetCurrent", "LaunchKernel", "EventRecord", "StreamWaitEvent", "DeviceGetAttribute"}

// driverCalls counts the driverOps that f makes.
func driverCalls(t *testing.T, d *fake.Driver, f func() error) []int {
	before := make([]int, len(driverOps))
	for i, op := range driverOps {
		before[i] = d.Calls(op)
	}
	require.NoError(t, f())
	got := make([]int, len(driverOps))
	for i, op := range driverOps {
		got[i] = d.Calls(op) - before[i]
	}
	return got
}

// TestHostPathDriverCalls pins the driver calls of each call kind once its kernels are loaded: on
// a GPU each costs microseconds (a launch about 4), the core's own work far less. The usual call
// (no previous_event, async_finish or allocate_on_comm_stream) after another on the same stream
// runs on that stream and needs no event record and no stream wait (order.go).
func TestHostPathDriverCalls(t *testing.T) {
	h := newHostBench(t)
	d := h.be.Driver().(*fake.Driver)
	want := map[string][]int{ // per driverOps
		"layout":          {1, 1, 0, 0, 0},
		"dispatch_bf16":   {1, 1, 0, 0, 0}, // notify and the data blocks in one kernel
		"dispatch_fp8":    {1, 1, 0, 0, 0},
		"dispatch_cached": {1, 1, 0, 0, 0}, // the kernel passes the call's barriers itself
		"combine":         {1, 1, 0, 0, 0},
		"ll_dispatch":     {1, 1, 0, 0, 0},
		"ll_combine":      {1, 1, 0, 0, 0},
	}
	calls, _ := h.hostCalls(t)
	for _, c := range calls {
		require.NoError(t, c.call())
		got := driverCalls(t, d, c.call)
		t.Logf("%-16s %v: %v", c.name, driverOps, got)
		assert.Equal(t, want[c.name], got, c.name)
	}
}

// Stream orders as Python's _order makes them, on stream s; ev is previous_event's CUevent.
func usual(s uintptr) goep.StreamOrder {
	return goep.StreamOrder{Stream: s, Flags: goep.OrderWait | goep.OrderJoin}
}
func async(s uintptr) goep.StreamOrder { return goep.StreamOrder{Stream: s, Flags: goep.OrderWait} }
func previous(s, ev uintptr) goep.StreamOrder {
	return goep.StreamOrder{Stream: s, Event: ev, Flags: goep.OrderPrevious | goep.OrderJoin}
}
func onComm(s, ev uintptr) goep.StreamOrder {
	return goep.StreamOrder{Stream: s, Event: ev, Flags: goep.OrderPrevious | goep.OrderOnComm}
}

// TestHostPathOrderDriverCalls pins the event records and stream waits of a combine (one launch)
// after another call, in every stream order: the waits the call's own order asks for on the comm
// stream (DeepEP's), plus one record and wait when the buffer's last work is on a stream that the
// call's stream neither is nor waits for anyway.
func TestHostPathOrderDriverCalls(t *testing.T) {
	h := newNormalBench(t)
	d := h.be.Driver().(*fake.Driver)
	calls, c := h.normalCalls(t)
	var combine func() error
	for _, hc := range calls {
		if hc.name == "combine" {
			combine = hc.call
		}
	}
	exit, err := h.be.Enter()
	require.NoError(t, err)
	b, err := d.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(t, err)
	ev, err := d.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)
	require.NoError(t, ev.Record(b))
	exit()
	t.Cleanup(func() {
		exit, err := h.be.Enter()
		require.NoError(t, err)
		defer exit()
		assert.NoError(t, ev.Destroy())
		assert.NoError(t, b.Destroy())
	})
	a, e, comm := h.stream, ev.Raw(), h.be.CommStream().Raw()
	for _, tt := range []struct {
		name                  string
		before, order         goep.StreamOrder
		launches, recs, waits int
	}{
		{"usual, again", usual(a), usual(a), 1, 0, 0},
		{"usual after async_finish", async(a), usual(a), 1, 1, 1},
		{"usual on stream B after A", usual(a), usual(b.Raw()), 1, 1, 1},
		{"usual on the legacy default stream after A", usual(a), usual(0), 1, 1, 1},
		{"usual on the comm stream itself", usual(comm), usual(comm), 1, 0, 0},
		{"usual with previous_event=EventOverlap(None)", usual(a),
			goep.StreamOrder{Stream: a, Flags: goep.OrderPrevious | goep.OrderWait | goep.OrderJoin}, 1, 0, 0},
		{"async_finish after usual", usual(a), async(a), 1, 1, 1},
		{"async_finish, again", async(a), async(a), 1, 1, 1},
		{"async_finish on B after usual on A", usual(a), async(b.Raw()), 1, 2, 2},
		{"previous_event after usual", usual(a), previous(a, e), 1, 2, 3},
		{"previous_event, again", previous(a, e), previous(a, e), 1, 1, 2},
		{"usual after previous_event", previous(a, e), usual(a), 1, 0, 0},
		{"allocate_on_comm_stream after usual", usual(a), onComm(a, e), 1, 1, 2},
		{"allocate_on_comm_stream, again", onComm(a, e), onComm(a, e), 1, 0, 1},
		{"usual after allocate_on_comm_stream", onComm(a, e), usual(a), 1, 1, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c.order = tt.before
			require.NoError(t, combine())
			c.order = tt.order
			got := driverCalls(t, d, combine)
			assert.Equal(t, []int{1, tt.launches, tt.recs, tt.waits, 0}, got, "%v", driverOps)
		})
	}

	// PYEP_COMM_STREAM=1: every call in DeepEP's order, on the comm stream.
	t.Run("PYEP_COMM_STREAM=1", func(t *testing.T) {
		t.Setenv("PYEP_COMM_STREAM", "1")
		h := newNormalBench(t)
		calls, _ := h.normalCalls(t)
		for _, hc := range calls {
			require.NoError(t, hc.call())
			got := driverCalls(t, h.be.Driver().(*fake.Driver), hc.call)
			assert.Equal(t, 2, got[2], "%s: event records", hc.name)
			assert.Equal(t, 2, got[3], "%s: stream waits", hc.name)
		}
	})
}

// The layout's workspace: allocated (and zeroed on the call's stream) by the first layout, kept
// for every later one whatever its experts (it holds no counts), and freed when the buffer is
// destroyed.
func TestLayoutWorkspaceLifetime(t *testing.T) {
	h := newNormalBench(t)
	d := h.be.Driver().(*fake.Driver)
	c := h.normalCase(t)
	perExpert := map[int64]goep.Desc{} // made before the counting starts: they allocate too
	for _, E := range []int64{hbE, 1000, 4096} {
		perExpert[E] = h.desc(t, dtI32, E, 0, 4)
	}
	layout := func(E int64) error {
		return h.buf.Layout(&goep.LayoutArgs{TopkIdx: c.topk, NumExperts: int(E), PerRank: c.perRank.Data,
			PerExpert: perExpert[E].Data, InRank: c.inRank.Data, Order: c.order})
	}
	counts := func() (int, int, int) { return d.Calls("MemAlloc"), d.Calls("MemsetD8Async"), d.Calls("MemFree") }
	a0, s0, _ := counts()
	require.NoError(t, layout(hbE))
	a1, s1, f1 := counts()
	assert.Equal(t, 1, a1-a0, "the first layout allocates its workspace")
	assert.Equal(t, 1, s1-s0, "and zeroes it on the call's stream")
	for _, E := range []int64{hbE, 1000, 4096} {
		require.NoError(t, layout(E))
	}
	a2, s2, f2 := counts()
	assert.Equal(t, a1, a2, "later layouts reuse it, whatever their experts")
	assert.Equal(t, s1, s2)
	assert.Equal(t, f1, f2)
	require.NoError(t, h.buf.Destroy())
	_, _, f3 := counts()
	// A buffer that made no layout frees one allocation fewer when destroyed.
	plain := newNormalBench(t)
	pd := plain.be.Driver().(*fake.Driver)
	pf := pd.Calls("MemFree")
	require.NoError(t, plain.buf.Destroy())
	assert.Equal(t, pd.Calls("MemFree")-pf+1, f3-f2, "the workspace freed with the buffer")
}
