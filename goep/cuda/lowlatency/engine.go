//go:build cgo

package cudall

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/env"
	"github.com/pyep/pyep/goep/lowlatency"
)

// Low-latency mode on the GPU: kernels/low_latency.cu over every rank's low-latency region
// (goep/lowlatency's layout), reached through a per-peer pointer table in device memory. Every
// kernel runs on the caller's stream and reads the call's sequence number from the region
// itself, so a call captured in a CUDA graph replays correctly: the host passes only the half,
// which alternates from call to call as the engine counts them (a graph must hold whole pairs of
// calls, as with DeepEP). A wait that times out masks the peer in this rank's region and fills
// the engine's error record (host-mapped); the host reads it at the next call and at hooks.
// The buffer's normal-mode kernels (goep/cuda/normal) share no memory with these: they use the
// NVLink region and records of their own, so the two engines need no order between them beyond
// the caller's streams' (see goep/cuda/normal/order.go).

// The launch parameters (llParams) and the error record (llError) are kernels/params.h's (abi.go);
// the kernels are the device's, compiled and kept by the cuda.Backend (goep/cuda/kernels.go).

const (
	llPhaseSend = 1
	llPhaseRecv = 2
	// llLocalBytes: calls [2]u64, then the receive's block counter (i32), from llPendingOff the
	// calls received but not yet acknowledged ([2]u32, a half each), from llDispatchCallsOff the
	// dispatch calls received ([2]u64, a half each: p.dcalls), then from llCombineSentOff the
	// combine send's counters (its blocks done, the messages a hooked send deferred to its hook:
	// kernels/low_latency_combine.cuh; an i32 per expert, llMaxExperts: p.expert_sent). Zero at the
	// start and after clean; the counters are zero again after each kernel.
	llPendingOff       = 24
	llDispatchCallsOff = 32
	llMaxExperts       = llSentWords
	llCombineSentOff   = 128
	llLocalBytes       = llCombineSentOff + 4*llMaxExperts
)

// Engine is one buffer's low-latency engine on a GPU.
type Engine struct {
	b        *cuda.Backend
	mu       sync.Mutex
	rank, n  int
	bytes    int64
	base     driver.DevicePtr // this rank's region
	peersDev driver.DevicePtr // u64 [n]: every rank's region as mapped here (or named, when remote); then i32 [n]: remote
	remote   bool             // some peer is remote: the kernels are the PYEP_LL_REMOTE build
	sharing  int              // ranks on this GPU
	sms      int              // the GPU's SMs, read once: a driver call per launch costs host time
	timeout  time.Duration
	localDev driver.DevicePtr // llLocalBytes: the kernels' own counters
	errHost  unsafe.Pointer
	errDev   driver.DevicePtr
	calls    uint64  // calls since clean: the next call's half is calls % 2
	stamps   *stamps // PYEP_LL_TIMELINE=1 when the engine was made: the kernels' timeline (timeline.go); else nil
	params   *llParams
	dead     error
	closed   bool
}

// Reach says which peers the engine reaches through kernels/remote.cuh (NVSHMEM on a GPU): those
// of other nodes, or every one but this rank with allow_nvlink_for_low_latency_mode=False.
type Reach struct {
	Remote []bool // by rank
	// Names are, by rank, what names a remote peer's region to remote_put: 0 (or no Names) for
	// this rank's own region, whose address NVSHMEM translates into the peer's (the region is in
	// its symmetric heap); the emulator's tests name the peers' mappings (goep/cuda/emu).
	Names []uint64
}

// table is the kernels' per-peer table: u64 [n] region addresses (a remote peer's name), then
// i32 [n] remote flags.
func (r *Reach) table(rank int, regions []unsafe.Pointer) ([]byte, bool, error) {
	n := len(regions)
	table := make([]byte, 12*n)
	some := false
	for p := range n {
		v := uint64(uintptr(regions[p]))
		if r != nil && r.Remote != nil && r.Remote[p] {
			if p == rank {
				return nil, false, fmt.Errorf("pyep: cuda: low-latency mode: rank %d cannot be remote to itself", p)
			}
			v = uint64(uintptr(regions[rank]))
			if p < len(r.Names) && r.Names[p] != 0 {
				v = r.Names[p]
			}
			binary.LittleEndian.PutUint32(table[8*n+4*p:], 1)
			some = true
		} else if v == 0 {
			return nil, false, fmt.Errorf("pyep: cuda: low-latency mode: rank %d's region is not mapped on rank %d", p, rank)
		}
		binary.LittleEndian.PutUint64(table[8*p:], v)
	}
	return table, some, nil
}

// New makes the engine of rank on b's GPU over regions (every rank's low-latency region as
// mapped here, numBytes each; nil for a remote peer), reaching the remote peers of reach (nil:
// none) through kernels/remote.cuh. sharing is how many ranks of the group use this GPU (their
// kernels share its SMs).
func New(b *cuda.Backend, rank int, regions []unsafe.Pointer, numBytes int64, sharing int, reach *Reach) (*Engine, error) {
	if reach != nil && reach.Remote != nil && len(reach.Remote) != len(regions) {
		return nil, fmt.Errorf("pyep: cuda: low-latency mode: %d remote flags for %d ranks", len(reach.Remote), len(regions))
	}
	table, remote, err := reach.table(rank, regions)
	if err != nil {
		return nil, err
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return nil, err
	}
	peers, err := b.Driver().MemAlloc(len(table))
	if err != nil {
		return nil, err
	}
	if err := b.Driver().MemcpyHtoD(peers, table); err != nil {
		_ = b.Driver().MemFree(peers)
		return nil, err
	}
	localDev, err := b.Driver().MemAlloc(llLocalBytes)
	if err == nil {
		err = b.Driver().MemsetD8(localDev, 0, llLocalBytes)
	}
	if err != nil {
		_ = b.Driver().MemFree(peers)
		return nil, err
	}
	sms, err := b.Device().Attribute(driver.AttrMultiprocessorCount)
	if err != nil {
		_ = b.Driver().MemFree(peers)
		_ = b.Driver().MemFree(localDev)
		return nil, err
	}
	errHost, errDev, err := b.HostAlloc(int(unsafe.Sizeof(llError{})))
	if err != nil {
		_ = b.Driver().MemFree(peers)
		_ = b.Driver().MemFree(localDev)
		return nil, err
	}
	e := &Engine{b: b, rank: rank, n: len(regions), bytes: numBytes, base: cuda.PtrOf(regions[rank]), peersDev: peers,
		remote: remote, sharing: max(1, sharing), sms: sms, timeout: b.Timeout(), localDev: localDev, errHost: errHost, errDev: errDev,
		params: new(llParams)}
	if env.Timeline() {
		if e.stamps, err = newStamps(b, max(e.grid(b.NormalOptions()), sms)); err != nil {
			_ = b.Driver().MemFree(peers)
			_ = b.Driver().MemFree(localDev)
			_ = b.Driver().MemFreeHost(errHost)
			return nil, err
		}
	}
	return e, nil
}

var _ goep.DeviceLowLatency = (*Engine)(nil)

// NewEngine makes the engine of one buffer on env.Backend's GPU, a *cuda.Backend, over regions
// (every rank's low-latency region as mapped here, numBytes each); tokens are every rank's
// region tokens, which tell the ranks that share the GPU. It is goep.Engines' LowLatency maker
// for cuda buffers (the composition root, goep/api, sets it).
func NewEngine(env goep.EngineEnv, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (goep.DeviceLowLatency, error) {
	b, err := cuda.BackendOf(env.Backend)
	if err != nil {
		return nil, err
	}
	var reach *Reach
	if env.Remote != nil {
		reach = &Reach{Remote: env.Remote}
	}
	e, err := New(b, env.Topo.Rank, regions, numBytes, b.RanksOnDevice(tokens), reach)
	if err != nil {
		return nil, err
	}
	return e, nil
}

// Close frees the engine's table and record once the GPU is done with them.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	b := e.b
	if err := b.SyncDevice(b.Timeout()); err != nil {
		return fmt.Errorf("pyep: cuda: closing the buffer's low-latency mode: %w", err)
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	return errors.Join(b.Driver().MemFree(e.peersDev), b.Driver().MemFree(e.localDev), b.Driver().MemFreeHost(e.errHost),
		e.stamps.free(b))
}

// Recv is the receive phase of a call launched with a hook.
type Recv struct {
	e      *Engine
	f      driver.Function
	params llParams
	opts   cuda.NormalOptions
	done   bool
}

// PeerFailure implements goep.PeerFailures: once the device is idle, the recorded failure (a
// peer that timed out), or nil.
func (e *Engine) PeerFailure() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return e.dead
	}
	if err := e.b.SyncDevice(e.b.Timeout()); err != nil {
		return nil // Close reports it
	}
	return e.failure()
}

// failure turns the error record into an error naming the peer, once.
func (e *Engine) failure() error {
	if e.dead != nil {
		return e.dead
	}
	rec := (*llError)(e.errHost)
	if rec.code == 0 {
		return nil
	}
	what := map[int32]string{1: "its acknowledgement of the previous call", 2: "its dispatch rows", 3: "its combine rows",
		4: "its combine's top-k selections"}[int32(rec.what)]
	e.dead = fmt.Errorf("pyep: rank %d timed out after %.1f s waiting for rank %d (%s); rank %d is masked on this rank: "+
		"with enable_shrink, calls go on without it; otherwise call clean_low_latency_buffer on every rank", e.rank,
		float64(rec.waited_ns)/1e9, int32(rec.peer), what, int32(rec.peer))
	return e.dead
}

// Launch queues a dispatch, or a combine, on c.Stream; with c.Hook only its send phase, and
// the returned Recv queues the receive.
func (e *Engine) Launch(combine bool, c *goep.LLCall) (goep.LLReceive, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.failure(); err != nil {
		return nil, err
	}
	l, err := e.layout(c.Shape)
	if err != nil {
		return nil, err
	}
	msg, err := newMsgFormat(l, c.UseFP8 && !combine)
	if err != nil {
		return nil, err
	}
	if combine && e.remote && l.NumLocalExperts < 2 {
		// The rows for peers on other nodes are staged in this rank's receive area past its R*M combine slots.
		return nil, goep.NotAvailablef("low_latency_combine across nodes: num_experts = %d over %d ranks: the cuda backend "+
			"needs at least 2 experts a rank there", l.NumExperts, e.n)
	}
	exit, err := e.b.Enter()
	defer exit()
	if err != nil {
		return nil, err
	}
	// goep refuses a call whose half still awaits a hook (the call two back): its send would wait
	// for an acknowledgement that the hook gives.
	h := int(e.calls % 2)
	opts := e.b.NormalOptions()
	kernel, def := cuda.KernelLLDispatch, "PYEP_LL_DISPATCH"
	if combine {
		kernel, def = cuda.KernelLLCombine, "PYEP_LL_COMBINE"
	}
	flags := int32(0)
	for i, on := range []bool{c.UseFP8, c.RoundScale, c.UseUE8M0, c.LogFMT} {
		if on {
			flags |= 1 << i
		}
	}
	// D: bit 0 the remote build (its own module, linked with NVSHMEM's device library on a GPU), bit 1 the timeline's.
	key := cuda.KernelKey{Kernel: kernel, A: int32(c.Shape.Hidden), B: int32(c.NumTopk), C: flags, Threads: int32(opts.LowLatencyThreads)}
	if e.remote {
		key.D |= 1
	}
	if e.stamps != nil {
		key.D |= 2
	}
	f, err := e.b.Kernel(key, func() map[string]string {
		d := map[string]string{def: "", "PYEP_LL_HIDDEN": itoa(c.Shape.Hidden), "PYEP_LL_TOPK": itoa(c.NumTopk),
			"PYEP_LL_FP8": b2s(c.UseFP8), "PYEP_LL_ROUND": b2s(c.RoundScale), "PYEP_LL_UE8M0": b2s(c.UseUE8M0),
			"PYEP_LL_THREADS": itoa(opts.LowLatencyThreads), "PYEP_LL_LOGFMT": b2s(c.LogFMT)}
		if e.remote {
			d[cuda.RemoteDefine] = ""
		}
		if e.stamps != nil {
			d[timelineDefine] = "1"
		}
		return d
	})
	if err != nil {
		return nil, err
	}
	p := e.params
	remoteTable := u64(0)
	if e.remote {
		remoteTable = u64(e.peersDev) + u64(8*e.n)
	}
	*p = llParams{peers: u64(e.peersDev), remote: remoteTable, err: u64(e.errDev), timeout_ns: u64(e.timeout.Nanoseconds()),
		calls: u64(e.localDev), counter: u64(e.localDev) + 16, off_ack: u64(l.Ack(0, 0)), off_mask: u64(l.Mask(0)),
		off_dflags: u64(l.DispatchFlags(h)), off_cflags: u64(l.CombineFlags(h)), off_ddone: u64(l.DispatchDone(h)), off_send: u64(l.Send(h)),
		off_recv: u64(l.Recv(h)), off_heads: u64(l.Recv(h) + msg.Heads), msg_header: u64(msg.Header),
		x: u64(c.X), topk_idx: u64(c.TopkIdx), topk_weights: u64(c.TopkWeights),
		recv_x: u64(c.RecvX), recv_scales: u64(c.RecvScales), src_info: u64(c.SrcInfo),
		layout_range: u64(c.LayoutRange), count: u64(c.Count), cum_stats: u64(c.CumStats),
		wait_stats: u64(c.WaitStats), out: u64(c.Out),
		rank: i32(e.rank), num_ranks: i32(e.n), num_experts: i32(c.Shape.NumExperts),
		max_tokens: i32(c.Shape.MaxTokens), num_tokens: i32(c.NumTokens), half: i32(h), phases: llPhaseSend | llPhaseRecv}
	p.pending = u64(e.localDev) + llPendingOff
	p.local = u64(e.base)
	p.off_push = u64(l.Push(h))
	if combine {
		p.expert_sent = u64(e.localDev) + llCombineSentOff
	} else {
		p.dcalls = u64(e.localDev) + llDispatchCallsOff
	}
	if c.ZeroCopy {
		p.zero_copy = 1
	}
	if e.stamps != nil {
		p.timeline = u64(e.stamps.dev)
	}
	if c.Hook {
		p.phases = llPhaseSend
	}
	s := e.b.WrapStream(c.Stream)
	if err := e.launch(f, s, p, opts); err != nil {
		return nil, err
	}
	e.calls++ // the half alternates with the calls queued
	if !c.Hook {
		return nil, nil
	}
	r := &Recv{e: e, f: f, params: *p, opts: opts}
	r.params.phases = llPhaseRecv
	return r, nil
}

// grid is the blocks of a low-latency kernel: one an SM, shared fairly among the ranks on this GPU
// (MPS runs their kernels at once), unless o sets them.
func (e *Engine) grid(o cuda.NormalOptions) int {
	if o.LowLatencyBlocks > 0 {
		return o.LowLatencyBlocks
	}
	return max(1, e.sms/e.sharing)
}

func (e *Engine) launch(f driver.Function, s driver.Stream, p *llParams, o cuda.NormalOptions) error {
	grid := e.grid(o)
	if e.stamps != nil && grid > e.stamps.blocks {
		return fmt.Errorf("pyep: cuda: low-latency timeline: %d blocks, stamps for %d (the options changed after the buffer was made)",
			grid, e.stamps.blocks)
	}
	return e.b.Launch(f, uint32(grid), uint32(o.LowLatencyThreads), s, unsafe.Pointer(p))
}

// Finish launches the receive phase on stream.
func (r *Recv) Finish(stream uintptr) error {
	e := r.e
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.done {
		return errors.New("the receive hook was already called")
	}
	r.done = true
	if err := e.failure(); err != nil {
		return err
	}
	exit, err := e.b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	*e.params = r.params
	return e.launch(r.f, e.b.WrapStream(stream), e.params, r.opts)
}

// Clean zeroes this rank's flags, acknowledgements, dispatch message headers, push flags and call counters, and with masks its masks
// too (the callers pass a barrier before and after), and forgets the recorded failure.
func (e *Engine) Clean(s lowlatency.Shape, masks bool) error {
	l, err := e.layout(s)
	if err != nil {
		return err
	}
	msg, err := newMsgFormat(l, false)
	if err != nil {
		return err
	}
	return e.idle(func() error {
		zero := [][2]int64{{l.Ack(0, 0), 16 * int64(e.n)}, {l.DispatchFlags(0), 2*l.FlagBytes + l.DoneBytes}, {l.DispatchFlags(1), 2*l.FlagBytes + l.DoneBytes}}
		// The dispatch headers and the combine's push flags too: the calls start again at seq 1, which a header or
		// flag of before could hold.
		for h := range 2 {
			zero = append(zero, [2]int64{l.Recv(h) + msg.Heads, int64(e.n*l.MaxTokens) * msg.Header}, [2]int64{l.PushFlag(h, 0), 8 * int64(e.n)})
		}
		if masks {
			zero = append(zero, [2]int64{l.Mask(0), 4 * int64(e.n)})
		}
		for _, z := range zero {
			if err := e.b.Driver().MemsetD8(e.base.Add(int(z[0])), 0, int(z[1])); err != nil {
				return err
			}
		}
		if err := e.b.Driver().MemsetD8(e.localDev, 0, llLocalBytes); err != nil {
			return err
		}
		*(*llError)(e.errHost) = llError{}
		e.dead, e.calls = nil, 0
		return nil
	})
}

// SetMask masks (or unmasks) rank p on this rank.
func (e *Engine) SetMask(p int, on bool) error {
	v := []byte{0, 0, 0, 0}
	if on {
		v[0] = 1
	}
	return e.idle(func() error { return e.b.Driver().MemcpyHtoD(e.maskWord(p), v) })
}

// Masks reads the masks of every rank (1: masked).
func (e *Engine) Masks(out []int32) error {
	raw := make([]byte, 4*e.n)
	return e.idle(func() error {
		if err := e.b.Driver().MemcpyDtoH(raw, e.maskWord(0)); err != nil {
			return err
		}
		for i := range out {
			out[i] = int32(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		return nil
	})
}

// layout is shape s's layout, checked against the region's size.
func (e *Engine) layout(s lowlatency.Shape) (lowlatency.Layout, error) {
	l, err := lowlatency.NewLayout(e.n, s)
	if err == nil {
		err = l.Fits(e.bytes)
	}
	if err == nil && s.NumExperts > llMaxExperts {
		// The dispatch send counts each expert's selections in the engine's llMaxExperts counters.
		err = fmt.Errorf("num_experts = %d: the cuda backend's low-latency mode takes at most %d: %w", s.NumExperts, llMaxExperts,
			lowlatency.ErrInvalid)
	}
	return l, err
}

// idle runs f with the engine locked, the context current and the device idle: the words f
// touches are the kernels' too.
func (e *Engine) idle(f func() error) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	exit, err := e.b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	if err := e.b.Driver().CtxSynchronize(); err != nil {
		return err
	}
	return f()
}

// maskWord is the address of rank p's mask word in this rank's header (which no shape changes).
func (e *Engine) maskWord(p int) driver.DevicePtr {
	l, _ := lowlatency.NewLayout(e.n, lowlatency.Shape{MaxTokens: 1, Hidden: lowlatency.ScaleBlock, NumExperts: e.n})
	return e.base.Add(int(l.Mask(p)))
}

func itoa(n int) string { return strconv.Itoa(n) }

func b2s(v bool) string {
	if v {
		return "1"
	}
	return "0"
}

// SetTimeout bounds the waits of the calls queued from now on.
func (e *Engine) SetTimeout(d time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if d > 0 {
		e.timeout = d
	}
}

// NextSend is the offset of the next call's send area (the rows of a zero-copy combine).
func (e *Engine) NextSend(s lowlatency.Shape) (int64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	l, err := e.layout(s)
	if err != nil {
		return 0, err
	}
	return l.Send(int(e.calls % 2)), nil
}
