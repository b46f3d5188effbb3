package goep

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/lowlatency"
)

// The low-latency mode of a Buffer. Every rank's RDMA buffer (num_rdma_bytes) is shared with its
// peers as the NVLink buffer is (Backend.Allocate and Open, its token in the rank's IPC handle,
// opened by Sync), and goep/lowlatency runs the calls over those regions; on a device, the engine
// that Params.Engines (or the backend) makes at Sync runs them instead (low_latency_device.go).
//
// Across nodes. On the cpu backend every rank is a process of one machine, so the regions are
// shared whatever the nodes (PYEP_RANKS_PER_NODE's, or DeepEP's nodes of 8 in a larger group):
// goep/lowlatency writes a peer of its own node directly and a peer of another node only through
// its remote path (remotePut/remoteSignal), the NVSHMEM contract that the GPU keeps. A device
// backend runs the mode across nodes over NVSHMEM (low_latency_nvshmem.go).

// lowLatency is a Buffer's low-latency engine and the regions it runs over.
type lowLatency struct {
	mu      sync.Mutex // one call at a time
	local   LocalRegion
	peers   []Region // by rank; peers[rank] is local
	engine  *lowlatency.Engine
	timeout time.Duration
	// hooks holds the receives that await their hook, by the call's seq.
	hooks map[uint32]*lowlatency.Recv

	// On a device (LowLatencyEngines) the backend's engine runs the calls instead of engine;
	// calls numbers them (since the last clean), shape is theirs, and deviceHooks keeps their
	// hooks' receives.
	device      DeviceLowLatency
	calls       uint32
	shape       lowlatency.Shape
	deviceHooks map[uint32]LLReceive

	// nvshmem: the region is made at sync in NVSHMEM's symmetric heap (usesNVSHMEM; local is
	// nil, and b.rdma is the region once synced); unavailable says why NVSHMEM cannot run here.
	nvshmem     bool
	unavailable error
}

// sharesLowLatency: whether this buffer's RDMA region is the shared low-latency region.
func (b *Buffer) sharesLowLatency() bool {
	p := b.params
	return p.LowLatencyMode && p.NumRDMABytes > 0 && (b.topo.NumRDMARanks == 1 || b.backend.DeviceID() < 0)
}

// remotePeers is the engine's path table: which peers it writes through the remote path, those
// of other nodes, or with allow_nvlink_for_low_latency_mode=False every peer but itself.
func (b *Buffer) remotePeers() []bool {
	t := b.topo
	remote, some := make([]bool, t.NumRanks), false
	for p := range remote {
		remote[p] = p != t.Rank && (b.params.NoNVLinkForLowLatency || !t.SameNode(p))
		some = some || remote[p]
	}
	if !some {
		return nil
	}
	return remote
}

// allocateRDMA makes the RDMA region: shared with the peers in low-latency mode on one node.
func (b *Buffer) allocateRDMA() (RDMARegion, error) {
	if b.usesNVSHMEM() {
		b.ll = &lowLatency{peers: make([]Region, b.topo.NumRanks), timeout: OpTimeout(), hooks: map[uint32]*lowlatency.Recv{},
			deviceHooks: map[uint32]LLReceive{}, nvshmem: true}
		return nil, nil
	}
	if !b.sharesLowLatency() {
		return b.backend.AllocateRDMA(b.params.NumRDMABytes)
	}
	r, err := b.backend.Allocate(b.params.NumRDMABytes, b.topo.NumRanks-1)
	if err != nil {
		return nil, err
	}
	b.ll = &lowLatency{local: r, peers: make([]Region, b.topo.NumRanks), timeout: OpTimeout(),
		hooks: map[uint32]*lowlatency.Recv{}, deviceHooks: map[uint32]LLReceive{}}
	b.ll.peers[b.topo.Rank] = r
	return r, nil
}

// openLowLatency opens every peer's low-latency region from its handle and makes the engine
// (over NVSHMEM from root, the root unique id, where the buffer uses it).
func (b *Buffer) openLowLatency(handles [][]byte, root []byte) error {
	ll, t := b.ll, b.topo
	if ll == nil {
		return nil
	}
	if ll.nvshmem {
		return b.openSymmetric(handles, root)
	}
	if len(handles) != t.NumRanks {
		return Argf("ipc_handles has %d entries: expected num_ranks = %d", len(handles), t.NumRanks)
	}
	if !bytes.Equal(handles[t.Rank], b.localHandle()) {
		return Argf("ipc_handles[%d] is not this rank's own handle: the handles belong to another buffer or are out of order", t.Rank)
	}
	decoded := make([]Handle, t.NumRanks)
	for r := range decoded {
		if r == t.Rank {
			continue
		}
		if handles[r] == nil {
			return Argf("ipc_handles[%d] is missing: in low-latency mode every rank must provide its handle", r)
		}
		h, err := DecodeHandle(handles[r])
		switch {
		case err != nil:
		case h.Backend != b.backend.Name() || h.Rank != r || h.NumRanks != t.NumRanks:
			err = fmt.Errorf("made by rank %d of %d on %s: expected rank %d of %d on %s", h.Rank, h.NumRanks, h.Backend, r, t.NumRanks, b.backend.Name())
		case h.RDMASize != b.params.NumRDMABytes || len(h.RDMAToken) == 0:
			err = fmt.Errorf("peer low-latency buffer has %d bytes: expected num_rdma_bytes = %d on every rank", h.RDMASize, b.params.NumRDMABytes)
		}
		if err != nil {
			return Argf("ipc_handles[%d]: %v", r, err)
		}
		decoded[r] = h
	}
	regions := make([]unsafe.Pointer, t.NumRanks)
	for r, h := range decoded {
		if r != t.Rank {
			region, err := b.backend.Open(h.RDMAToken, h.RDMASize)
			if err != nil {
				return fmt.Errorf("open peer %d's low-latency buffer: %w", r, err)
			}
			ll.peers[r] = region
		}
		regions[r] = ll.peers[r].Data()
	}
	if maker := b.lowLatencyMaker(); maker != nil {
		tokens := make([][]byte, t.NumRanks)
		for r := range tokens {
			tokens[r] = decoded[r].RDMAToken
		}
		tokens[t.Rank] = ll.local.Token()
		env := EngineEnv{Backend: b.backend, Topo: t, NumNVLBytes: b.params.NumNVLBytes}
		d, err := maker(env, regions, b.params.NumRDMABytes, tokens)
		if err != nil {
			return err
		}
		d.SetTimeout(ll.timeout)
		ll.device = d
		return nil
	}
	if b.backend.DeviceID() >= 0 {
		// Device memory and no device engine (Params.Engines names none): the host cannot run
		// goep/lowlatency over it, so the calls report that the mode is not available.
		return nil
	}
	e, err := lowlatency.NewEngine(lowlatency.Domain{Rank: t.Rank, NumRanks: t.NumRanks, Regions: regions,
		NumBytes: b.params.NumRDMABytes, Timeout: ll.timeout, Shrink: b.params.EnableShrink, Remote: b.remotePeers()})
	ll.engine = e
	return err
}

// lowLatencyMaker is what makes the buffer's device engine: Params.Engines' maker, else the
// backend's own (LowLatencyEngines); nil where neither is (on host memory goep runs
// goep/lowlatency itself).
func (b *Buffer) lowLatencyMaker() func(EngineEnv, []unsafe.Pointer, int64, [][]byte) (DeviceLowLatency, error) {
	if maker := b.params.Engines.LowLatency; maker != nil {
		return maker
	}
	if be, ok := b.backend.(LowLatencyEngines); ok {
		return func(env EngineEnv, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (DeviceLowLatency, error) {
			return be.NewLowLatencyEngine(env.Topo.Rank, regions, numBytes, tokens)
		}
	}
	return nil
}

// closeLowLatencyPeers unmaps the peers' low-latency regions (the local one is b.rdma).
func (b *Buffer) closeLowLatencyPeers() {
	if b.ll == nil {
		return
	}
	if b.ll.device != nil {
		// The engine waits for the device's work on the regions before they are unmapped.
		_ = b.ll.device.Close()
		b.ll.device = nil
	}
	for r, p := range b.ll.peers {
		if p != nil && r != b.topo.Rank {
			_ = p.Close()
			b.ll.peers[r] = nil
		}
	}
	b.ll.engine = nil
}

// LowLatencySizeHint is get_low_latency_rdma_size_hint.
func LowLatencySizeHint(maxTokens, hidden, numRanks, numExperts int) (int64, error) {
	n, err := lowlatency.SizeHint(numRanks, lowlatency.Shape{MaxTokens: maxTokens, Hidden: hidden, NumExperts: numExperts})
	return n, llErr(err)
}

// lowLatency returns the engine of a synced low-latency buffer, locked; callers unlock ll.mu.
func (b *Buffer) lowLatency(op string) (*lowLatency, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.state == destroyed:
		return nil, errDestroyed
	case b.state != available:
		return nil, errNotSynced
	case !b.params.LowLatencyMode:
		return nil, Argf("%s: the buffer was made with low_latency_mode=False", op)
	case b.params.NumRDMABytes == 0:
		return nil, Argf("%s: low-latency mode needs num_rdma_bytes > 0 (see Buffer.get_low_latency_rdma_size_hint)", op)
	case b.ll != nil && b.ll.nvshmem && b.ll.unavailable != nil:
		return nil, b.nvshmemUnavailable(op)
	case b.ll == nil || b.ll.engine == nil && b.ll.device == nil:
		return nil, fmt.Errorf("%s: low-latency mode is not available on the %s backend with %d ranks", op, b.backend.Name(), b.topo.NumRanks)
	}
	b.ll.mu.Lock()
	return b.ll, nil
}

func llErr(err error) error {
	if err != nil && errors.Is(err, lowlatency.ErrInvalid) {
		return &ArgumentError{msg: err.Error()}
	}
	return err
}

func view[T any](addr uintptr, n int) []T {
	if addr == 0 {
		return nil
	}
	return unsafe.Slice((*T)(dlpack.Pointer(addr)), n)
}

// LLDispatchArgs are a checked (by the Python layer: dtypes, shapes, contiguity) low-latency
// dispatch's tensors as data addresses, and its sizes; see lowlatency.DispatchArgs.
type LLDispatchArgs struct {
	MaxTokens, Hidden, NumExperts, NumTokens, NumTopk          int
	UseFP8, RoundScale, UseUE8M0, Hook                         bool
	X, TopkIdx, RecvX, RecvScales, SrcInfo, LayoutRange, Count uintptr
	CumStats, WaitStats                                        uintptr
	Stream                                                     uintptr // the caller's (device engines)
}

// LowLatencyDispatch runs a dispatch's send phase and, without Hook, its receive; with Hook it
// returns the seq that LowLatencyReceive takes.
func (b *Buffer) LowLatencyDispatch(a *LLDispatchArgs) (uint32, error) {
	ll, err := b.lowLatency("low_latency_dispatch")
	if err != nil {
		return 0, err
	}
	defer ll.mu.Unlock()
	R, T, H, K := b.topo.NumRanks, a.NumTokens, a.Hidden, a.NumTopk
	if R < 1 || a.NumExperts%R != 0 || a.NumExperts < 1 || H < 1 || a.MaxTokens < 1 || T < 0 || K < 1 {
		return 0, Argf("low_latency_dispatch: num_experts = %d: expected a positive multiple of num_ranks = %d", a.NumExperts, R)
	}
	L, RM := a.NumExperts/R, R*a.MaxTokens
	shape := lowlatency.Shape{MaxTokens: a.MaxTokens, Hidden: H, NumExperts: a.NumExperts}
	if ll.device != nil {
		if err := checkDeviceCall(R, shape, T, K, a.UseFP8, a.RoundScale, a.UseUE8M0); err != nil {
			return 0, err
		}
		return ll.launchDevice(false, &LLCall{Shape: shape, NumTokens: T, NumTopk: K, UseFP8: a.UseFP8, RoundScale: a.RoundScale,
			UseUE8M0: a.UseUE8M0, Hook: a.Hook, X: a.X, TopkIdx: a.TopkIdx, RecvX: a.RecvX, RecvScales: a.RecvScales,
			SrcInfo: a.SrcInfo, LayoutRange: a.LayoutRange, Count: a.Count, CumStats: a.CumStats, WaitStats: a.WaitStats,
			Stream: a.Stream})
	}
	rowBytes, words := 2*H, 0
	if a.UseFP8 {
		rowBytes, words = H, H/lowlatency.ScaleBlock
		if a.UseUE8M0 {
			words = (words + 3) / 4
		}
	}
	op := &lowlatency.DispatchArgs{Shape: lowlatency.Shape{MaxTokens: a.MaxTokens, Hidden: H, NumExperts: a.NumExperts},
		NumTokens: T, NumTopk: K, UseFP8: a.UseFP8, RoundScale: a.RoundScale, UseUE8M0: a.UseUE8M0,
		X: view[uint16](a.X, T*H), TopkIdx: view[int64](a.TopkIdx, T*K), RecvX: view[byte](a.RecvX, L*RM*rowBytes),
		RecvScales: view[uint32](a.RecvScales, L*RM*words), SrcInfo: view[int32](a.SrcInfo, L*RM),
		LayoutRange: view[int64](a.LayoutRange, L*R), Count: view[int32](a.Count, L),
		CumStats: view[int32](a.CumStats, L), WaitStats: view[int64](a.WaitStats, R)}
	if op.X == nil {
		op.X = []uint16{}
	}
	if op.TopkIdx == nil {
		op.TopkIdx = []int64{}
	}
	recv, err := ll.engine.Dispatch(op)
	return ll.finish(recv, a.Hook, err)
}

// finish runs a receive now, or keeps it for its hook.
func (ll *lowLatency) finish(recv *lowlatency.Recv, hook bool, err error) (uint32, error) {
	if err != nil {
		return 0, llErr(err)
	}
	if hook {
		ll.hooks[recv.Seq()] = recv
		return recv.Seq(), nil
	}
	return recv.Seq(), llErr(recv.Finish())
}

// LowLatencyReceive is the hook of call seq: it waits for and finishes its receive (on a device,
// queues it on stream).
func (b *Buffer) LowLatencyReceive(seq uint32, stream uintptr) error {
	ll, err := b.lowLatency("hook")
	if err != nil {
		return err
	}
	defer ll.mu.Unlock()
	if ll.device != nil {
		recv, ok := ll.deviceHooks[seq]
		if !ok {
			return Argf("hook: low-latency call %d has no receive waiting: its hook ran already, or clean_low_latency_buffer ran since", seq)
		}
		delete(ll.deviceHooks, seq)
		return llErr(recv.Finish(stream))
	}
	recv, ok := ll.hooks[seq]
	if !ok {
		return Argf("hook: low-latency call %d has no receive waiting: its hook ran already, or clean_low_latency_buffer ran since", seq)
	}
	delete(ll.hooks, seq)
	return llErr(recv.Finish())
}

// LLCombineArgs are a checked low-latency combine's tensors as data addresses (X = 0 with
// ZeroCopy), and its sizes; see lowlatency.CombineArgs.
type LLCombineArgs struct {
	MaxTokens, Hidden, NumExperts, NumTokens, NumTopk int
	ZeroCopy, Hook, LogFMT                            bool
	X, TopkIdx, TopkWeights, SrcInfo, LayoutRange     uintptr
	Out, WaitStats                                    uintptr
	Stream                                            uintptr // the caller's (device engines)
}

// LowLatencyCombine runs a combine's send phase and, without Hook, its receive.
func (b *Buffer) LowLatencyCombine(a *LLCombineArgs) (uint32, error) {
	ll, err := b.lowLatency("low_latency_combine")
	if err != nil {
		return 0, err
	}
	defer ll.mu.Unlock()
	R, T, H, K := b.topo.NumRanks, a.NumTokens, a.Hidden, a.NumTopk
	if a.NumExperts%R != 0 || a.NumExperts < 1 || H < 1 || a.MaxTokens < 1 || T < 0 || K < 1 {
		return 0, Argf("low_latency_combine: num_experts = %d: expected a positive multiple of num_ranks = %d", a.NumExperts, R)
	}
	if a.ZeroCopy && a.LogFMT { // as DeepEP refuses it
		return 0, Argf("low_latency_combine: zero_copy=True and use_logfmt=True: a zero-copy combine sends bf16 rows " +
			"(expected at most one of them)")
	}
	L, RM := a.NumExperts/R, R*a.MaxTokens
	if ll.device != nil {
		shape := lowlatency.Shape{MaxTokens: a.MaxTokens, Hidden: H, NumExperts: a.NumExperts}
		if err := checkDeviceCall(R, shape, T, K, false, false, false); err != nil {
			return 0, err
		}
		return ll.launchDevice(true, &LLCall{Shape: shape, NumTokens: T, NumTopk: K, ZeroCopy: a.ZeroCopy, LogFMT: a.LogFMT, Hook: a.Hook,
			X: a.X, TopkIdx: a.TopkIdx, TopkWeights: a.TopkWeights, SrcInfo: a.SrcInfo, LayoutRange: a.LayoutRange,
			Out: a.Out, WaitStats: a.WaitStats, Stream: a.Stream})
	}
	op := &lowlatency.CombineArgs{Shape: lowlatency.Shape{MaxTokens: a.MaxTokens, Hidden: H, NumExperts: a.NumExperts},
		NumTokens: T, NumTopk: K, ZeroCopy: a.ZeroCopy, LogFMT: a.LogFMT, X: view[uint16](a.X, L*RM*H),
		SrcInfo: view[int32](a.SrcInfo, L*RM), LayoutRange: view[int64](a.LayoutRange, L*R),
		TopkIdx: view[int64](a.TopkIdx, T*K), TopkWeights: view[float32](a.TopkWeights, T*K), Out: view[uint16](a.Out, T*H),
		WaitStats: view[int64](a.WaitStats, R)}
	for _, s := range []*[]int64{&op.TopkIdx} {
		if *s == nil {
			*s = []int64{}
		}
	}
	if op.TopkWeights == nil {
		op.TopkWeights = []float32{}
	}
	if op.Out == nil {
		op.Out = []uint16{}
	}
	recv, err := ll.engine.Combine(op)
	return ll.finish(recv, a.Hook, err)
}

// LowLatencyClean is clean_low_latency_buffer (collective); pending hooks become stale.
func (b *Buffer) LowLatencyClean(maxTokens, hidden, numExperts int) error {
	ll, err := b.lowLatency("clean_low_latency_buffer")
	if err != nil {
		return err
	}
	defer ll.mu.Unlock()
	clear(ll.hooks)
	shape := lowlatency.Shape{MaxTokens: maxTokens, Hidden: hidden, NumExperts: numExperts}
	if ll.device != nil {
		// Without enable_shrink a mask only marks a peer that timed out: clean forgets it too.
		clear(ll.deviceHooks)
		ll.calls, ll.shape = 0, lowlatency.Shape{}
		return llErr(ll.device.Clean(shape, !b.params.EnableShrink))
	}
	return llErr(ll.engine.Clean(shape))
}

// LowLatencyNextCombineBuffer is the offset in the RDMA buffer of the rows [L][R*M][H] bf16
// that the next combine sends with zero_copy.
func (b *Buffer) LowLatencyNextCombineBuffer(maxTokens, hidden, numExperts int) (int64, error) {
	ll, err := b.lowLatency("get_next_low_latency_combine_buffer")
	if err != nil {
		return 0, err
	}
	defer ll.mu.Unlock()
	shape := lowlatency.Shape{MaxTokens: maxTokens, Hidden: hidden, NumExperts: numExperts}
	if ll.device != nil {
		off, err := ll.device.NextSend(shape)
		return off, llErr(err)
	}
	off, err := ll.engine.NextCombineBuffer(shape)
	return off, llErr(err)
}

// SetLowLatencyTimeout bounds this buffer's low-latency waits on a peer (PYEP_TIMEOUT_S as
// Python reads it: Go's copy of the environment is the one of the process's start).
func (b *Buffer) SetLowLatencyTimeout(d time.Duration) error {
	ll, err := b.lowLatency("PYEP_TIMEOUT_S")
	if err != nil {
		return err
	}
	defer ll.mu.Unlock()
	if d <= 0 {
		return Argf("PYEP_TIMEOUT_S: %v, expected a positive number of seconds", d)
	}
	ll.timeout = d
	if ll.device != nil {
		ll.device.SetTimeout(d)
		return nil
	}
	ll.engine.SetTimeout(d)
	return nil
}

// LowLatencyTimedOut returns and forgets the ranks that timed out and were masked (enable_shrink).
func (b *Buffer) LowLatencyTimedOut() ([]int, error) {
	ll, err := b.lowLatency("low_latency_dispatch")
	if err != nil {
		return nil, err
	}
	defer ll.mu.Unlock()
	if ll.device != nil {
		return nil, nil // a device engine masks the peer; low_latency_query_mask_buffer shows it
	}
	return ll.engine.TimedOut(), nil
}

// LowLatencyMask is low_latency_update_mask_buffer (rank >= 0), or, with rank = -1,
// low_latency_clean_mask_buffer; query (not nil) receives low_latency_query_mask_buffer's [R].
func (b *Buffer) LowLatencyMask(op string, rank int, mask bool, query uintptr) error {
	if !b.params.EnableShrink {
		return Argf("%s: masks need enable_shrink=True (and low_latency_mode=True)", op)
	}
	ll, err := b.lowLatency(op)
	if err != nil {
		return err
	}
	defer ll.mu.Unlock()
	if ll.device != nil {
		// query is host memory here: the Python layer copies it to the caller's tensor.
		switch {
		case query != 0:
			return llErr(ll.device.Masks(view[int32](query, b.topo.NumRanks)))
		case rank == -1:
			for p := range b.topo.NumRanks {
				if err := ll.device.SetMask(p, false); err != nil {
					return err
				}
			}
			return nil
		case rank < 0 || rank >= b.topo.NumRanks:
			return Argf("rank_to_mask = %d: expected 0 <= rank_to_mask < num_ranks = %d", rank, b.topo.NumRanks)
		}
		return llErr(ll.device.SetMask(rank, mask))
	}
	switch {
	case query != 0:
		ll.engine.Masks(view[int32](query, b.topo.NumRanks))
	case rank == -1:
		ll.engine.CleanMasks()
	default:
		return llErr(ll.engine.SetMask(rank, mask))
	}
	return nil
}
