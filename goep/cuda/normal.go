package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/jit"
)

// Normal mode on the GPU: *Backend implements goep.NormalEngine with the kernels of
// kernels/layout.cu and kernels/intranode.cu (see intranode.cu for the memory layout and the
// protocol), compiled by NVRTC for this GPU and the call's shape, cached (goep/jit).
//
// Every kernel runs on the backend's communication stream. Layout and Notify wait on the host
// for their results (mapped host memory): layout to report an out-of-range expert index, notify
// for the number of rows to receive. Dispatch and Combine only queue their kernels.
//
// Failures: a kernel that times out (PYEP_TIMEOUT_S) or finds the ranks' arguments
// inconsistent fills its buffer's error record (mapped host memory) and makes every rank's
// kernels stop. The host reads the record at the start of every call and while it waits, so a
// failure of an asynchronous dispatch or combine is reported by the next call on the buffer;
// from then on the buffer refuses work (its ranks no longer agree on where the protocol
// stands): destroy it and make a new one. Arguments that are wrong on every rank alike
// (num_worst_tokens too small) or on some rank (an expert index out of range,
// num_tokens_per_rank not matching is_token_in_rank) are found by notify on every rank before
// any data moves, and the call raises ValueError on the rank at fault, an error naming it on
// the others; the buffer stays usable.

// KernelLoader provides the kernels; the default compiles with NVRTC. file is a kernel source
// ("intranode.cu"), kernel the entry point, defines the constants it is specialised on.
type KernelLoader interface {
	Load(b *Backend, file, kernel string, defines map[string]string) (Function, error)
}

// NormalOptions tune the normal-mode engine; tests set them (SetNormalOptions), the zero value
// is the default.
type NormalOptions struct {
	Loader KernelLoader // nil: NVRTC for the device's architecture
	// Block sizes of dispatch/combine, notify and layout; 0: 768 (PYEP_NORMAL_THREADS, a
	// multiple of 32 up to 1024, read at start-up, overrides it), 1024, 512.
	Threads, NotifyThreads, LayoutThreads int
}

// normalThreads is the block size of dispatch and combine: PYEP_NORMAL_THREADS when valid.
var normalThreads = parseNormalThreads(os.Getenv("PYEP_NORMAL_THREADS"))

// parseNormalThreads is s as a block size of dispatch and combine (a multiple of 32 from 64 to
// 1024), else 768.
func parseNormalThreads(s string) int {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 64 || n > 1024 || n%32 != 0 {
		return 768
	}
	return n
}

// SetNormalOptions replaces the engine's options and forgets the kernels loaded so far.
func (b *Backend) SetNormalOptions(o NormalOptions) {
	e := b.engine()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.opts = o.withDefaults()
	e.kernels = map[kernelKey]Function{}
}

func (o NormalOptions) withDefaults() NormalOptions {
	if o.Threads == 0 {
		o.Threads = normalThreads
	}
	if o.NotifyThreads == 0 {
		o.NotifyThreads = 1024
	}
	if o.LayoutThreads == 0 {
		o.LayoutThreads = 512
	}
	return o
}

// opTimeout is the bound of every wait of a kernel on a peer: PYEP_TIMEOUT_S (seconds, read
// at start-up), 100 s by default, or what SetOpTimeout set.
var opTimeout atomic.Int64

func init() {
	d := DefaultTimeout
	if s, err := strconv.ParseFloat(os.Getenv("PYEP_TIMEOUT_S"), 64); err == nil && s > 0 {
		d = time.Duration(s * float64(time.Second))
	}
	opTimeout.Store(int64(d))
}

// SetOpTimeout changes the bound of the kernels' waits for calls made from now on.
func SetOpTimeout(d time.Duration) {
	if d > 0 {
		opTimeout.Store(int64(d))
	}
}

// OpTimeout is the bound of the kernels' waits.
func OpTimeout() time.Duration { return time.Duration(opTimeout.Load()) }

// extraFlags are further NVRTC options for every kernel, from PYEP_JIT_FLAGS (space-separated,
// e.g. "-lineinfo" for compute-sanitizer's source lines).
var extraFlags = strings.Fields(os.Getenv("PYEP_JIT_FLAGS"))

// debugSync (PYEP_DEBUG_SYNC=1, a debugging aid) makes every launch wait for its kernel and
// name the kernel that failed.
var debugSync = os.Getenv("PYEP_DEBUG_SYNC") == "1"

// launch queues f on the communication stream with one parameter struct.
func (e *normalEngine) launch(f Function, grid, block uint32, params unsafe.Pointer) error {
	if err := f.Launch([3]uint32{grid, 1, 1}, [3]uint32{block, 1, 1}, 0, e.b.comm, params); err != nil {
		return err
	}
	e.b.lastLaunch.Store(monotonicNS())
	if debugSync {
		if err := e.b.comm.Synchronize(); err != nil {
			return fmt.Errorf("pyep: kernel %s failed: %w; launch parameters: %#v", f.name, err, *e.params)
		}
	}
	return nil
}

// hostGrace is how much longer than the kernels' own bound the host waits for a result before
// it gives up on the GPU (the kernel may have started late, behind other work).
const hostGrace = 5 * time.Second

// spinFor is how long waitHost polls without sleeping.
const spinFor = 20 * time.Millisecond

// Shapes of the host-device structs; kernels/intranode.cu and layout.cu have the same.
type kctx struct {
	Data, Ctl                                  [8]uint64
	Err, Seq, TimeoutNS, CounterBytes, HeadOff uint64
	Rank, NumChannels, RingSlots, Chunk        int32
}

type notifyParams struct {
	Ctx                                                         kctx
	InRank, PerRank, PerExpert, Topk, RankPrefix, ChannelPrefix uint64
	RecvChannelPrefix, RecvPerExpert, Result, ScratchOff        uint64
	BlockBytes                                                  uint64
	NumTokens, NumTopk, NumExperts, Alignment, NumWorst         int32
	Capacity                                                    int32
	LayoutRec, LayoutTag                                        uint64
}

type prologueParams struct {
	Ctx     kctx
	Op, Pad int32
}

type dispatchParams struct {
	Ctx                                                                  kctx
	X, XScales, Topk, Weights, InRank, RankPrefix, ChannelPrefix         uint64
	RecvX, RecvScales, RecvSrc, RecvTopk, RecvWeights, RecvChannelPrefix uint64
	SendHead                                                             uint64
	OffHidden, OffScales, OffSrc, OffTopk, OffWeights                    uint64
	NumTokens, NumExperts, NumOutRows, ScaleTokenStride                  int32
	ScaleStride, Pad                                                     int32
	GoSeq                                                                uint64
}

type combineParams struct {
	Ctx                                                            kctx
	X, Weights, SrcIdx, RankPrefix, ChannelPrefix, SendHead, Bias0 uint64
	Bias1, Out, OutWeights                                         uint64
	OffRow, OffSrc, OffWeights                                     uint64
	NumTokens, NumRows, Pad0, Pad1                                 int32
}

type layoutParams struct {
	Topk, PerRank, PerExpert, InRank, Result, Tag uint64
	NumTokens, NumTopk, NumExperts, NumRanks      int32
}

// opError is the kernels' error record (OpError in intranode.cu).
type opError struct {
	Code                    uint32
	Op, Rank, Channel, Peer int32
	What                    int32
	A, B, C                 int64
	WaitedNS, AbortWord     uint64
}

// notifyResult is notify's answer (NotifyResult in intranode.cu), followed by the per-expert
// counts.
type notifyResult struct {
	Tag                                  uint64
	NumRecv, Status, BadRank, PeerStatus int32
	D0, D1, D2                           int64
	Go, Pad                              int32
}

// Sizes the kernels static_assert or declare.
const (
	ctxBytes          = 184
	notifyParamsBytes = 312
	opErrorBytes      = 64
	notifyResultBytes = 56
)

// kernel files and kinds.
const (
	kindNotify = iota + 1
	kindDispatch
	kindCombine
	kindLayout
)

// kernelKey identifies a compiled variant; comparable, so a lookup allocates nothing.
type kernelKey struct {
	kind, name                 int8
	ranks, a, b, c, d, threads int32
}

const (
	nameNotify = iota + 1
	namePrologue
	nameDispatch
	nameCombine
	nameLayout
)

var kernelNames = map[int8]string{nameNotify: "pyep_notify", namePrologue: "pyep_prologue",
	nameDispatch: "pyep_dispatch", nameCombine: "pyep_combine", nameLayout: "pyep_layout"}

// bufferState is what the engine keeps per NVLink buffer (this rank's region).
type bufferState struct {
	seq      uint64 // the next barrier number; every rank numbers alike
	dead     error  // set once a kernel failed: the buffer refuses work
	reported bool   // dead was returned once already

	errHost unsafe.Pointer // opError, host-mapped
	errDev  DevicePtr
	resHost unsafe.Pointer // notifyResult + per-expert counts, host-mapped
	resDev  DevicePtr
	resCap  int // per-expert counts resHost has room for

	notified   bool  // the last call was a successful notify: the dispatch after it needs no prologue
	scratchOff int64 // where that notify's scratch starts
	perExpert  []int32
}

type normalEngine struct {
	b    *Backend
	mu   sync.Mutex
	opts NormalOptions
	arch string

	kernels map[kernelKey]Function
	sources map[string]jit.Source
	states  map[*localRegion]*bufferState

	// The record of the last layout's bad index (u64 [4]: tag, token << 32 | choice, value),
	// written by the layout kernel and read by the next notify; layoutTag numbers the layouts.
	layoutHost unsafe.Pointer
	layoutDev  DevicePtr
	layoutTag  uint64

	// Launch parameters, reused by every launch (a launch copies them), in an allocation of
	// their own that holds no Go pointer, as cgo requires of memory a C call reaches.
	params *launchParams
}

type launchParams struct {
	notify   notifyParams
	prologue prologueParams
	dispatch dispatchParams
	combine  combineParams
	layout   layoutParams
}

func (b *Backend) engine() *normalEngine {
	b.normalOnce.Do(func() {
		b.normal = &normalEngine{b: b, opts: NormalOptions{}.withDefaults(), kernels: map[kernelKey]Function{},
			sources: map[string]jit.Source{}, states: map[*localRegion]*bufferState{}, params: new(launchParams)}
	})
	return b.normal
}

var _ goep.NormalEngine = (*Backend)(nil)

// forgetNormal frees what the engine keeps for a region that is being freed; the region's
// work on the GPU is done.
func (b *Backend) forgetNormal(l *localRegion) {
	if b.normal == nil {
		return
	}
	e := b.normal
	e.mu.Lock()
	st := e.states[l]
	delete(e.states, l)
	e.mu.Unlock()
	if st == nil {
		return
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return
	}
	for _, p := range []unsafe.Pointer{st.errHost, st.resHost} {
		if p != nil {
			_ = b.drv.MemFreeHost(p)
		}
	}
}

// hostAlloc allocates zeroed, device-mapped host memory.
func (b *Backend) hostAlloc(n int) (unsafe.Pointer, DevicePtr, error) {
	p, err := b.drv.MemHostAlloc(n, HostAllocPortable|HostAllocDeviceMap)
	if err != nil {
		return nil, 0, err
	}
	d, err := b.drv.MemHostGetDevicePointer(p)
	if err != nil {
		_ = b.drv.MemFreeHost(p)
		return nil, 0, err
	}
	clear(unsafe.Slice((*byte)(p), n))
	return p, d, nil
}

// state returns the engine's state of this rank's region; the context is current.
func (e *normalEngine) state(r goep.Region) (*bufferState, *localRegion, error) {
	l, ok := r.(*localRegion)
	if !ok {
		return nil, nil, errors.New("pyep: cuda: this rank's buffer is not a region of this backend")
	}
	if st := e.states[l]; st != nil {
		return st, l, nil
	}
	st := &bufferState{seq: 1}
	var err error
	if st.errHost, st.errDev, err = e.b.hostAlloc(opErrorBytes); err != nil {
		return nil, nil, err
	}
	e.states[l] = st
	return st, l, nil
}

// usable reports a failure recorded by an earlier kernel of the buffer.
func (e *normalEngine) usable(st *bufferState) error {
	if st.dead == nil {
		st.dead = e.recorded(st)
	}
	if st.dead == nil {
		return nil
	}
	if !st.reported {
		st.reported = true
		return st.dead
	}
	return fmt.Errorf("this buffer failed earlier and is unusable (destroy it and make a new one): %w", st.dead)
}

// recorded reads the buffer's error record: nil while no kernel failed.
func (e *normalEngine) recorded(st *bufferState) error {
	rec := (*opError)(st.errHost)
	if atomic.LoadUint32(&rec.Code) == 0 {
		return nil
	}
	r := *rec
	return errors.New(describeFailure(&r) + "; the buffer is unusable from now on: destroy it and make a new one")
}

var opNames = map[int32]string{1: "dispatch (notify)", 2: "prologue", 3: "dispatch", 4: "combine"}

func describeFailure(r *opError) string {
	msg := fmt.Sprintf("%s: rank %d", opNames[r.Op], r.Rank)
	if r.Channel >= 0 {
		msg += fmt.Sprintf(" channel %d", r.Channel)
	}
	switch r.Code {
	case 1:
		return msg + fmt.Sprintf(": timed out after %v waiting for rank %d to %s", time.Duration(r.WaitedNS).Round(time.Millisecond),
			r.Peer, waitText(r.What, r.A, r.B, r.C))
	case 2:
		return msg + ": " + mismatchText(r.What, r.Peer, r.A, r.B, r.C)
	case 3:
		w := r.AbortWord
		origin, what, peer := int32(w>>56&0x7f), int32(w>>48&0xff), int32(int8(w>>40&0xff))
		code, channel := uint32(w>>32&0xff), int32(uint32(w))
		cause := "failed"
		switch code {
		case 1:
			cause = fmt.Sprintf("timed out waiting for rank %d to %s", peer, waitText(what, -1, -1, -1))
		case 2:
			cause = "found " + mismatchText(what, peer, -1, -1, -1)
		}
		where := ""
		if channel >= 0 {
			where = fmt.Sprintf(" on channel %d", channel)
		}
		return msg + fmt.Sprintf(": stopped because rank %d %s%s", origin, cause, where)
	}
	return msg + fmt.Sprintf(": failed with code %d", r.Code)
}

func waitText(what int32, a, b, c int64) string {
	known := a >= 0
	switch what {
	case 1:
		if known {
			return fmt.Sprintf("join the call (barrier #%d; it last reached #%d: it did not make this call, or is stuck in an earlier one)", a, b)
		}
		return "join the call (it did not make this call, or is stuck in an earlier one)"
	case 2:
		if known {
			return fmt.Sprintf("push tokens (received %d of %d)", a, b)
		}
		return "push tokens"
	case 3:
		if known {
			return fmt.Sprintf("free ring slots (head %d, pushed %d, ring of %d slots)", a, b, c)
		}
		return "free ring slots"
	case 4:
		return "announce its token count"
	case 5:
		if known {
			return fmt.Sprintf("return token %d (its slot %d, pushed %d)", a, b, c)
		}
		return "return tokens"
	}
	return "make progress"
}

func mismatchText(what, peer int32, a, b, c int64) string {
	known := a >= 0 || b >= 0
	switch what {
	case 10:
		if known {
			return fmt.Sprintf("rank %d sends %d tokens here but rank_prefix_matrix says %d (a handle of another dispatch?)", peer, a, b)
		}
		return fmt.Sprintf("a token count of rank %d that does not match rank_prefix_matrix", peer)
	case 11:
		return fmt.Sprintf("is_token_in_rank routes other tokens to rank %d than channel_prefix_matrix says", peer)
	case 12:
		if known {
			return fmt.Sprintf("the rows [%d, %d) from rank %d do not fit the %d output rows", a, b, peer, c)
		}
		return "more rows than the outputs hold"
	case 13:
		if known {
			return fmt.Sprintf("rank %d returned the row of token %d where send_head expects token %d (a handle of another dispatch?)", peer, a, b)
		}
		return "a returned row of another token than send_head expects"
	case 14:
		if known {
			return fmt.Sprintf("rank %d returns %d rows but send_head expects %d (a handle of another dispatch?)", peer, a, b)
		}
		return "a row count that does not match send_head"
	case 15:
		if known {
			return fmt.Sprintf("channel_prefix_matrix[%d] = %d is not an exclusive prefix within the %d rows from rank %d", peer, a, c, peer)
		}
		return "an invalid channel_prefix_matrix"
	case 16:
		if known {
			return fmt.Sprintf("send_head[%d, %d] = %d but rank %d returns only %d rows", a, peer, b, peer, c)
		}
		return "a send_head beyond what a rank returns"
	}
	return fmt.Sprintf("an inconsistency (%d)", what)
}

// function returns the kernel of key, loading it on first use; the context is current.
func (e *normalEngine) function(key kernelKey, file string, defines func() map[string]string) (Function, error) {
	if f, ok := e.kernels[key]; ok {
		return f, nil
	}
	name := kernelNames[key.name]
	var f Function
	var err error
	if e.opts.Loader != nil {
		f, err = e.opts.Loader.Load(e.b, file, name, defines())
	} else {
		f, err = e.nvrtc(file, name, defines())
	}
	if err != nil {
		return Function{}, fmt.Errorf("pyep: loading kernel %s of %s: %w", name, file, err)
	}
	e.kernels[key] = f
	return f, nil
}

// nvrtc compiles file for this GPU (through jit's cache) and loads the kernel.
func (e *normalEngine) nvrtc(file, name string, defines map[string]string) (Function, error) {
	if e.arch == "" {
		arch, err := e.b.dev.Arch()
		if err != nil {
			return Function{}, err
		}
		e.arch = arch
	}
	src, ok := e.sources[file]
	if !ok {
		var err error
		if src, err = jit.Kernel(file); err != nil {
			return Function{}, err
		}
		e.sources[file] = src
	}
	cubin, err := jit.Compile(src, jit.Options{Arch: e.arch, Defines: defines, Flags: extraFlags})
	if err != nil {
		return Function{}, err
	}
	mod, err := e.b.drv.ModuleLoadData(cubin)
	if err != nil {
		return Function{}, err
	}
	return mod.Function(name)
}

func itoa(n int) string { return strconv.Itoa(n) }

// The constants each kernel variant is compiled with (the engine's choices; exported for tools
// that fill the kernel cache ahead of time).

// LayoutDefines are layout.cu's for blocks of threads.
func LayoutDefines(threads int) map[string]string {
	return map[string]string{"PYEP_LAYOUT_THREADS": itoa(threads), "PYEP_LAYOUT_EXPERTS_PER_BLOCK": itoa(layoutExpertsPerBlock)}
}

// NotifyDefines are those of notify and the prologue (intranode.cu) for numRanks ranks.
func NotifyDefines(numRanks, notifyThreads, threads int) map[string]string {
	return map[string]string{"PYEP_NOTIFY": "", "PYEP_RANKS": itoa(numRanks), "PYEP_NOTIFY_THREADS": itoa(notifyThreads),
		"PYEP_THREADS": itoa(threads)}
}

// DispatchDefines are the dispatch kernel's: rows of hiddenBytes (+ scalesBytes of scales),
// topk indices per token (0 for a cached dispatch), moved as vec-byte vectors.
func DispatchDefines(numRanks, hiddenBytes, scalesBytes, topk, vec, threads int) map[string]string {
	return map[string]string{"PYEP_DISPATCH": "", "PYEP_RANKS": itoa(numRanks), "PYEP_HIDDEN_BYTES": itoa(hiddenBytes),
		"PYEP_SCALES_BYTES": itoa(scalesBytes), "PYEP_TOPK": itoa(topk), "PYEP_VEC": itoa(vec), "PYEP_THREADS": itoa(threads)}
}

// CombineDefines are the combine kernel's: rows of hidden elements of dtype (1 bf16, 2 fp16,
// 3 fp32), topk weights per row (0 for none), vec-byte vectors.
func CombineDefines(numRanks, hidden, dtype, topk, vec, threads int) map[string]string {
	return map[string]string{"PYEP_COMBINE": "", "PYEP_RANKS": itoa(numRanks), "PYEP_HIDDEN": itoa(hidden),
		"PYEP_DTYPE": itoa(dtype), "PYEP_TOPK": itoa(topk), "PYEP_VEC": itoa(vec), "PYEP_THREADS": itoa(threads)}
}

const layoutExpertsPerBlock = 64

// begin locks the engine and enters the context; end undoes both.
func (e *normalEngine) begin() (end func(), err error) {
	e.mu.Lock()
	exit, err := e.b.Enter()
	if err != nil {
		exit()
		e.mu.Unlock()
		return func() {}, err
	}
	return func() { exit(); e.mu.Unlock() }, nil
}

// enterBuffer begins a call on this rank's region of peers: the engine locked, the context
// entered, the region's state, whether the call before was a successful notify (cleared now),
// and the buffer's recorded failure if it has one. end undoes begin, also after an error.
func (e *normalEngine) enterBuffer(topo goep.Topology, peers []goep.Region) (end func(), st *bufferState, l *localRegion, notified bool, err error) {
	if end, err = e.begin(); err != nil {
		return end, nil, nil, false, err
	}
	if st, l, err = e.state(peers[topo.NVLRank]); err != nil {
		return end, nil, nil, false, err
	}
	notified, st.notified = st.notified, false
	return end, st, l, notified, e.usable(st)
}

// ptr is a tensor's device address (0 for an absent tensor).
func ptr(t dlpack.Tensor) uint64 {
	if !t.Valid {
		return 0
	}
	return uint64(uintptr(t.Data))
}

// orderBefore makes the call's work on the communication stream wait for previous_event, or
// else for the caller's stream (DeepEP's stream semantics); the engine is locked and the context
// current, so the order costs no call of its own.
func (e *normalEngine) orderBefore(o goep.StreamOrder) error {
	b := e.b
	switch {
	case o.Event != 0:
		return b.comm.WaitEvent(WrapEvent(b.drv, o.Event))
	case o.Flags&goep.OrderWait != 0:
		return b.streamWait(b.comm, b.WrapStream(o.Stream))
	}
	return nil
}

// orderAfter makes the caller's stream wait for the call's work, unless async_finish.
func (e *normalEngine) orderAfter(o goep.StreamOrder) error {
	if o.Flags&goep.OrderJoin == 0 {
		return nil
	}
	return e.b.streamWait(e.b.WrapStream(o.Stream), e.b.comm)
}

func align(n, a int64) int64 { return (n + a - 1) / a * a }

// ringWords is the kernels' kSubRings: tail and head words per ring, the most sub-rings a ring
// is split into (one per sending warp of a peer).
const ringWords = 32

// counters is the size of the tails (u64) and heads (u32) of C*R rings, and where the heads start.
func counters(numChannels, numRanks int) (headOff, total int64) {
	words := int64(numChannels) * int64(numRanks) * ringWords
	headOff = align(8*words, 128)
	return headOff, headOff + align(4*words, 128)
}

// notifyScratch is the size of one sender's block and of the whole scratch.
func notifyScratch(numRanks, numChannels, numExperts int) (block, total int64) {
	block = align(32+4*int64(numRanks+numChannels+numExperts/numRanks+1), 16)
	return block, block * int64(numRanks)
}

// dispatchLayout places the dispatch rings' fields after the counters.
func dispatchLayout(numChannels, numRanks, slots, hiddenBytes, scalesBytes, topk int) (off [5]int64, end int64) {
	_, pos := counters(numChannels, numRanks)
	s := int64(numChannels) * int64(numRanks) * int64(slots)
	for i, size := range []int64{int64(hiddenBytes), int64(scalesBytes), 4, 8 * int64(topk), 4 * int64(topk)} {
		off[i] = pos
		pos += align(s*size, 128)
	}
	return off, pos
}

// combineLayout places the combine rings' fields after the counters.
func combineLayout(numChannels, numRanks, slots, rowBytes, topk int) (off [3]int64, end int64) {
	_, pos := counters(numChannels, numRanks)
	s := int64(numChannels) * int64(numRanks) * int64(slots)
	for i, size := range []int64{int64(rowBytes), 4, 4 * int64(topk)} {
		off[i] = pos
		pos += align(s*size, 128)
	}
	return off, pos
}

// vecBytes is the widest vector (16, 8, 4, 2 or 1 bytes) that divides rowBytes and every
// address.
func vecBytes(rowBytes int, addrs ...uint64) int {
	for v := 16; v > 1; v /= 2 {
		ok := rowBytes%v == 0
		for _, a := range addrs {
			ok = ok && a%uint64(v) == 0
		}
		if ok {
			return v
		}
	}
	return 1
}

// fillCtx sets the parts of ctx every kernel of a call shares.
func (e *normalEngine) fillCtx(ctx *kctx, st *bufferState, topo goep.Topology, peers []goep.Region, cfg goep.Config) {
	for i := range ctx.Data {
		ctx.Data[i], ctx.Ctl[i] = 0, 0
	}
	for i, p := range peers {
		ctx.Data[i] = uint64(PtrOf(p.Data()))
		ctx.Ctl[i] = uint64(PtrOf(p.Control()))
	}
	headOff, total := counters(cfg.NumChannels(), topo.NumNVLRanks)
	ctx.Err = uint64(st.errDev)
	ctx.Seq = st.seq
	ctx.TimeoutNS = uint64(OpTimeout())
	ctx.CounterBytes = uint64(total)
	ctx.HeadOff = uint64(headOff)
	ctx.Rank = int32(topo.NVLRank)
	ctx.NumChannels = int32(cfg.NumChannels())
	ctx.RingSlots = int32(cfg.NumMaxNVLChunkedRecvTokens)
	ctx.Chunk = int32(cfg.NumMaxNVLChunkedSendTokens)
}

func tooSmall(op string, rank int, have, need int64, what string) error {
	return goep.Argf("%s: rank %d: num_nvl_bytes = %d is too small: %s need %d bytes (see Config.get_nvl_buffer_size_hint)",
		op, rank, have, what, need)
}

// waitHost polls the u64 at tag until it holds want: the answer of a kernel on the
// communication stream. It gives up when the buffer's error record fills (st != nil), the
// stream fails, or the kernels' timeout plus a grace passes.
func (e *normalEngine) waitHost(tag *uint64, want uint64, st *bufferState, what string) error {
	limit := OpTimeout() + hostGrace
	start := time.Now()
	pause := time.Duration(0)
	for i := 0; ; i++ {
		if atomic.LoadUint64(tag) == want {
			return nil
		}
		if st != nil {
			if err := e.recorded(st); err != nil {
				return err
			}
		}
		if i%256 == 255 {
			if _, err := e.b.comm.Query(); err != nil {
				return fmt.Errorf("pyep: %s: the communication stream failed: %w", what, err)
			}
			if time.Since(start) > limit {
				return fmt.Errorf("pyep: %s: no answer from the GPU within %v (the communication stream is stuck behind other work, or a kernel hangs)", what, limit)
			}
		}
		// A sleep costs tens of microseconds of latency, as much as a notify takes: spin (as
		// DeepEP does) while the answer may come soon, back off only in a long wait.
		if i < 1<<10 || time.Since(start) < spinFor {
			runtime.Gosched()
			continue
		}
		pause = min(max(2*pause, time.Microsecond), 200*time.Microsecond)
		time.Sleep(pause)
	}
}

// Layout implements goep.NormalEngine: the counts on the GPU, queued without a wait (DeepEP's
// layout does not synchronise either). Its check of every expert index is recorded on the GPU
// and reported by the next dispatch's notify, on every rank.
func (b *Backend) Layout(a *goep.LayoutOp) error {
	e := b.engine()
	end, err := e.begin()
	defer end()
	if err != nil {
		return err
	}
	if e.layoutHost == nil {
		if e.layoutHost, e.layoutDev, err = b.hostAlloc(32); err != nil {
			return err
		}
	}
	T, K := int32(a.TopkIdx.Shape[0]), int32(a.TopkIdx.Shape[1])
	E, R := int32(a.NumExperts), int32(a.NumRanks)
	threads := int32(e.opts.LayoutThreads)
	f, err := e.function(kernelKey{kind: kindLayout, name: nameLayout, threads: threads}, "layout.cu",
		func() map[string]string { return LayoutDefines(int(threads)) })
	if err != nil {
		return err
	}
	p := &e.params.layout
	*p = layoutParams{Topk: ptr(a.TopkIdx), PerRank: ptr(a.PerRank), PerExpert: ptr(a.PerExpert), InRank: ptr(a.InRank),
		Result: uint64(e.layoutDev), Tag: e.layoutTag + 1, NumTokens: T, NumTopk: K, NumExperts: E, NumRanks: R}
	grid := uint32(R + (E+layoutExpertsPerBlock-1)/layoutExpertsPerBlock)
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	if err := e.launch(f, grid, uint32(threads), unsafe.Pointer(p)); err != nil {
		return err
	}
	e.layoutTag++
	return e.orderAfter(a.Order)
}

// Notify implements goep.NormalEngine.
func (b *Backend) Notify(topo goep.Topology, peers []goep.Region, a *goep.NotifyOp) (int, error) {
	e := b.engine()
	end, st, l, _, err := e.enterBuffer(topo, peers)
	defer end()
	if err != nil {
		return 0, err
	}
	f, scratchOff, err := e.prepareNotify(st, l, topo, peers, a)
	if err != nil {
		return 0, err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return 0, err
	}
	seq, err := e.launchNotify(f, st)
	if err != nil {
		return 0, err
	}
	n, _, err := e.finishNotify(st, seq, topo, a, scratchOff)
	if err != nil {
		return 0, err
	}
	return n, e.orderAfter(a.Order)
}

// NotifyDispatch implements goep.SpeculativeEngine: notify, and behind it on the stream the
// dispatch into rows allocated before the counts are known (n.Capacity of them), then the
// wait for notify's answer. The dispatch runs only if every rank's rows fit (notify's verdict,
// the same on every rank); otherwise it returns at once, ran is false, and the caller
// dispatches again into exact rows (that Dispatch follows the notify, as after Notify). n.Order
// orders both: the stream order of a dispatch that does not run is the later Dispatch's.
func (b *Backend) NotifyDispatch(topo goep.Topology, peers []goep.Region, n *goep.NotifyOp, d *goep.DispatchOp) (numRecv int, ran bool, err error) {
	if n.Capacity <= 0 || int64(n.Capacity) != d.RecvX.Shape[0] {
		return 0, false, goep.Argf("dispatch: capacity = %d for %d allocated rows", n.Capacity, d.RecvX.Shape[0])
	}
	e := b.engine()
	end, st, l, _, err := e.enterBuffer(topo, peers)
	defer end()
	if err != nil {
		return 0, false, err
	}
	// Everything is checked and compiled before the first launch: once notify runs, the peers
	// count on this rank's dispatch.
	fn, scratchOff, err := e.prepareNotify(st, l, topo, peers, n)
	if err != nil {
		return 0, false, err
	}
	fd, off, err := e.prepareDispatch(st, l, topo, d, scratchOff)
	if err != nil {
		return 0, false, err
	}
	if err := e.orderBefore(n.Order); err != nil {
		return 0, false, err
	}
	seq, err := e.launchNotify(fn, st)
	if err != nil {
		return 0, false, err
	}
	e.fillDispatch(st, topo, peers, d, off, seq)
	if err := e.launch(fd, uint32(2*d.Config.NumChannels()), uint32(e.opts.Threads), unsafe.Pointer(&e.params.dispatch)); err != nil {
		if st.dead == nil {
			st.dead = fmt.Errorf("pyep: dispatch: the launch after its notify failed: %w", err)
		}
		return 0, false, err
	}
	numRecv, ran, err = e.finishNotify(st, seq, topo, n, scratchOff)
	if err != nil || !ran {
		return numRecv, ran, err
	}
	st.notified = false // the dispatch consumed the notify
	return numRecv, ran, e.orderAfter(n.Order)
}

// prepareNotify checks a notify, finds its kernel and fills its launch parameters.
func (e *normalEngine) prepareNotify(st *bufferState, l *localRegion, topo goep.Topology, peers []goep.Region,
	a *goep.NotifyOp) (f Function, scratchOff int64, err error) {
	b := e.b
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	E := a.NumExperts
	switch {
	case a.ExpertAlignment < 1 || a.ExpertAlignment > 1<<20:
		return f, 0, goep.Argf("dispatch: expert_alignment = %d must be in [1, 2^20]", a.ExpertAlignment)
	case a.NumWorstTokens < 0 || a.NumWorstTokens > 1<<31-2:
		return f, 0, goep.Argf("dispatch: num_worst_tokens = %d is out of range", a.NumWorstTokens)
	case a.NumTokens > 1<<31-2:
		return f, 0, goep.Argf("dispatch: num_tokens = %d is out of range", a.NumTokens)
	case a.Capacity < 0 || a.Capacity > 1<<31-2:
		return f, 0, goep.Argf("dispatch: capacity = %d is out of range", a.Capacity)
	}
	blockBytes, scratch := notifyScratch(R, C, E)
	scratchOff = (l.size - scratch) / 16 * 16
	_, counterBytes := counters(C, R)
	if counterBytes > scratchOff {
		return f, 0, tooSmall("dispatch", me, l.size, counterBytes+scratch,
			fmt.Sprintf("the ring counters and the count exchange of %d ranks, %d channels and %d experts", R, C, E))
	}
	epr := E / R
	if st.resCap < epr {
		if st.resHost != nil {
			_ = b.drv.MemFreeHost(st.resHost)
			st.resHost, st.resCap = nil, 0
		}
		n := max(epr, 256)
		if st.resHost, st.resDev, err = b.hostAlloc(notifyResultBytes + 4*n); err != nil {
			return f, 0, err
		}
		st.resCap = n
	}
	threads := int32(e.opts.NotifyThreads)
	key := kernelKey{kind: kindNotify, name: nameNotify, ranks: int32(R), threads: threads}
	if f, err = e.function(key, "intranode.cu", func() map[string]string { return NotifyDefines(R, int(threads), e.opts.Threads) }); err != nil {
		return f, 0, err
	}
	p := &e.params.notify
	e.fillCtx(&p.Ctx, st, topo, peers, a.Config)
	K := int32(0)
	if a.TopkIdx.Valid {
		K = int32(a.TopkIdx.Shape[1])
	}
	p.InRank, p.PerRank, p.PerExpert, p.Topk = ptr(a.InRank), ptr(a.PerRank), ptr(a.PerExpert), ptr(a.TopkIdx)
	if K == 0 {
		p.Topk = 0
	}
	p.RankPrefix, p.ChannelPrefix, p.RecvChannelPrefix = ptr(a.RankPrefix), ptr(a.ChannelPrefix), ptr(a.RecvChannelPrefix)
	p.RecvPerExpert, p.Result = ptr(a.RecvPerExpert), uint64(st.resDev)
	p.ScratchOff, p.BlockBytes = uint64(scratchOff), uint64(blockBytes)
	p.NumTokens, p.NumTopk, p.NumExperts = int32(a.NumTokens), K, int32(E)
	p.Alignment, p.NumWorst, p.Capacity = int32(a.ExpertAlignment), int32(a.NumWorstTokens), int32(a.Capacity)
	p.LayoutRec, p.LayoutTag = 0, 0
	if e.layoutTag > 0 {
		p.LayoutRec, p.LayoutTag = uint64(e.layoutDev), e.layoutTag
	}
	return f, scratchOff, nil
}

// launchNotify queues the prepared notify; it returns the notify's barrier number.
func (e *normalEngine) launchNotify(f Function, st *bufferState) (seq uint64, err error) {
	seq = st.seq
	if err := e.launch(f, 1, uint32(e.opts.NotifyThreads), unsafe.Pointer(&e.params.notify)); err != nil {
		return 0, err
	}
	st.seq += 2
	return seq, nil
}

// finishNotify waits for the answer of the notify with barrier number seq.
func (e *normalEngine) finishNotify(st *bufferState, seq uint64, topo goep.Topology, a *goep.NotifyOp, scratchOff int64) (int, bool, error) {
	res := (*notifyResult)(st.resHost)
	if err := e.waitHost(&res.Tag, seq, st, "dispatch (notify)"); err != nil {
		if st.dead == nil {
			st.dead, st.reported = err, true
		}
		return 0, false, err
	}
	r := *res
	E, me := a.NumExperts, topo.NVLRank
	switch r.Status {
	case 0:
	case 4:
		return 0, false, fmt.Errorf("dispatch: rank %d: no rank dispatches: rank %d has invalid arguments: %v", me, r.BadRank,
			statusError(r.PeerStatus, int(r.BadRank), r.D0, r.D1, r.D2, E))
	case 5:
		return 0, false, goep.Argf("dispatch: num_worst_tokens = %d is too small: rank %d receives %d tokens", a.NumWorstTokens, r.BadRank, r.D0)
	default:
		return 0, false, statusError(r.Status, me, r.D0, r.D1, r.D2, E)
	}
	epr := E / topo.NumNVLRanks
	st.perExpert = append(st.perExpert[:0], unsafe.Slice((*int32)(unsafe.Add(st.resHost, notifyResultBytes)), epr)...)
	st.notified, st.scratchOff = true, scratchOff
	return int(r.NumRecv), r.Go != 0, nil
}

// statusError is rank's own invalid argument as notify found it.
func statusError(status int32, rank int, d0, d1, d2 int64, numExperts int) error {
	switch status {
	case 1:
		return goep.Argf("dispatch: rank %d: topk_idx[%d,%d] = %d is out of range [0, %d) (or -1 for no expert)", rank, d0, d1, d2, numExperts)
	case 2:
		return goep.Argf("dispatch: rank %d: num_tokens_per_rank[%d] = %d but is_token_in_rank routes %d tokens to rank %d", rank, d0, d1, d2, d0)
	case 3:
		return goep.Argf("dispatch: rank %d: num_tokens_per_expert[%d] = %d is out of range", rank, d0, d1)
	case 6:
		return goep.Argf("dispatch: rank %d: in its last get_dispatch_layout, topk_idx[%d,%d] = %d is out of range [0, %d) "+
			"(or -1 for no expert); on cuda the layout does not wait for the GPU, so the dispatch after it reports the index", rank, d0, d1, d2, numExperts)
	}
	return fmt.Errorf("dispatch: rank %d: notify status %d", rank, status)
}

// RecvPerExpert is num_recv_tokens_per_expert of the last notify of this rank's region (the
// host's copy: no device synchronisation).
func (b *Backend) RecvPerExpert(r goep.Region) ([]int32, error) {
	e := b.engine()
	e.mu.Lock()
	defer e.mu.Unlock()
	l, ok := r.(*localRegion)
	if !ok || e.states[l] == nil {
		return nil, errors.New("pyep: no dispatch on this buffer yet")
	}
	return append([]int32(nil), e.states[l].perExpert...), nil
}

// prologueFor launches the barrier and counter reset in front of a cached dispatch or a combine.
func (e *normalEngine) prologueFor(op int32, st *bufferState, topo goep.Topology, peers []goep.Region, cfg goep.Config) error {
	threads := int32(e.opts.NotifyThreads)
	key := kernelKey{kind: kindNotify, name: namePrologue, ranks: int32(topo.NumNVLRanks), threads: threads}
	f, err := e.function(key, "intranode.cu", func() map[string]string {
		return NotifyDefines(topo.NumNVLRanks, int(threads), e.opts.Threads)
	})
	if err != nil {
		return err
	}
	p := &e.params.prologue
	e.fillCtx(&p.Ctx, st, topo, peers, cfg)
	p.Op = op
	if err := e.launch(f, 1, 256, unsafe.Pointer(p)); err != nil {
		return err
	}
	st.seq += 2
	return nil
}

// Dispatch implements goep.NormalEngine: it queues the kernels and returns.
func (b *Backend) Dispatch(topo goep.Topology, peers []goep.Region, a *goep.DispatchOp) error {
	e := b.engine()
	end, st, l, notified, err := e.enterBuffer(topo, peers)
	defer end()
	if err != nil {
		return err
	}
	// After a notify its scratch (at the end of every region) may still be read by a peer.
	limit := l.size
	if notified {
		limit = st.scratchOff
	}
	f, off, err := e.prepareDispatch(st, l, topo, a, limit)
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	if !notified {
		if err := e.prologueFor(3, st, topo, peers, a.Config); err != nil {
			return err
		}
	}
	e.fillDispatch(st, topo, peers, a, off, 0)
	if err := e.launch(f, uint32(2*a.Config.NumChannels()), uint32(e.opts.Threads), unsafe.Pointer(&e.params.dispatch)); err != nil {
		return err
	}
	return e.orderAfter(a.Order)
}

// prepareDispatch checks a dispatch whose rings must end by limit (the region's end, or the
// scratch of the notify before it) and finds its kernel.
func (e *normalEngine) prepareDispatch(st *bufferState, l *localRegion, topo goep.Topology, a *goep.DispatchOp, limit int64) (f Function, off [5]int64, err error) {
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	slots := a.Config.NumMaxNVLChunkedRecvTokens
	switch {
	case a.NumTopk > goep.MaxTopK:
		return f, off, goep.Argf("dispatch: num_topk = %d: at most %d supported", a.NumTopk, goep.MaxTopK)
	case a.NumTopk > 0 && (a.NumExperts <= 0 || a.NumExperts%R != 0):
		return f, off, goep.Argf("dispatch: num_experts = %d must be a positive multiple of num_ranks = %d", a.NumExperts, R)
	case a.HiddenBytes <= 0 || a.HiddenBytes > 1<<24 || a.ScalesBytes%4 != 0 || a.ScalesBytes > 1<<16:
		return f, off, goep.Argf("dispatch: %d bytes of hidden and %d of scales per token are not supported", a.HiddenBytes, a.ScalesBytes)
	}
	off, need := dispatchLayout(C, R, slots, a.HiddenBytes, a.ScalesBytes, a.NumTopk)
	if need > limit {
		what := "the rings"
		if limit < l.size {
			what = "the rings (and the count exchange after them)"
		}
		return f, off, tooSmall("dispatch", me, l.size, need+l.size-limit, fmt.Sprintf("%s of %d ranks x %d channels x %d slots of %d bytes (hidden %d, scales %d, top-k %d) with %v",
			what, R, C, slots, a.HiddenBytes+a.ScalesBytes+4+12*a.NumTopk, a.HiddenBytes, a.ScalesBytes, a.NumTopk, configString(a.Config)))
	}
	threads := int32(e.opts.Threads)
	vec := vecBytes(a.HiddenBytes, ptr(a.X), ptr(a.RecvX))
	key := kernelKey{kind: kindDispatch, name: nameDispatch, ranks: int32(R), a: int32(a.HiddenBytes), b: int32(a.ScalesBytes),
		c: int32(a.NumTopk), d: int32(vec), threads: threads}
	f, err = e.function(key, "intranode.cu", func() map[string]string {
		return DispatchDefines(R, a.HiddenBytes, a.ScalesBytes, a.NumTopk, vec, int(threads))
	})
	return f, off, err
}

// fillDispatch fills the dispatch's launch parameters; goSeq is the notify that must let a
// speculative dispatch run (0: it runs).
func (e *normalEngine) fillDispatch(st *bufferState, topo goep.Topology, peers []goep.Region, a *goep.DispatchOp, off [5]int64, goSeq uint64) {
	p := &e.params.dispatch
	e.fillCtx(&p.Ctx, st, topo, peers, a.Config)
	p.X, p.XScales, p.Topk, p.Weights, p.InRank = ptr(a.X), ptr(a.XScales), ptr(a.TopkIdx), ptr(a.TopkWeights), ptr(a.InRank)
	p.RankPrefix, p.ChannelPrefix = ptr(a.RankPrefix), ptr(a.ChannelPrefix)
	p.RecvX, p.RecvScales, p.RecvSrc = ptr(a.RecvX), ptr(a.RecvXScales), ptr(a.RecvSrcIdx)
	p.RecvTopk, p.RecvWeights = ptr(a.RecvTopkIdx), ptr(a.RecvTopkWeights)
	p.RecvChannelPrefix, p.SendHead = ptr(a.RecvChannelPrefix), ptr(a.SendHead)
	p.OffHidden, p.OffScales, p.OffSrc, p.OffTopk, p.OffWeights = uint64(off[0]), uint64(off[1]), uint64(off[2]), uint64(off[3]), uint64(off[4])
	p.NumTokens, p.NumExperts, p.NumOutRows = int32(a.NumTokens), int32(a.NumExperts), int32(a.RecvX.Shape[0])
	// Scales in words (goep checked that the strides fit); zero strides are dense rows.
	p.ScaleTokenStride, p.ScaleStride = int32(a.ScalesTokenStride), int32(a.ScalesStride)
	if p.ScaleTokenStride == 0 && p.ScaleStride == 0 {
		p.ScaleTokenStride, p.ScaleStride = int32(a.ScalesBytes/4), 1
	}
	p.GoSeq = goSeq
}

func configString(c goep.Config) string {
	return fmt.Sprintf("Config(num_sms=%d, num_max_nvl_chunked_send_tokens=%d, num_max_nvl_chunked_recv_tokens=%d)",
		c.NumSMs, c.NumMaxNVLChunkedSendTokens, c.NumMaxNVLChunkedRecvTokens)
}

// Combine implements goep.NormalEngine: it queues the kernels and returns.
func (b *Backend) Combine(topo goep.Topology, peers []goep.Region, a *goep.CombineOp) error {
	e := b.engine()
	end, st, l, _, err := e.enterBuffer(topo, peers)
	defer end()
	if err != nil {
		return err
	}
	R, me, C := topo.NumNVLRanks, topo.NVLRank, a.Config.NumChannels()
	slots := a.Config.NumMaxNVLChunkedRecvTokens
	var dtype, es int32
	switch a.X.DType {
	case dlpack.BF16:
		dtype, es = 1, 2
	case dlpack.F16:
		dtype, es = 2, 2
	case dlpack.F32:
		dtype, es = 3, 4
	default:
		return goep.Argf("combine: x: dtype %v is not supported (bfloat16, float16 or float32)", a.X.DType)
	}
	rowBytes := a.Hidden * int(es)
	switch {
	case a.NumTopk > goep.MaxTopK:
		return goep.Argf("combine: num_topk = %d: at most %d supported", a.NumTopk, goep.MaxTopK)
	case rowBytes > 1<<24:
		return goep.Argf("combine: hidden = %d is not supported", a.Hidden)
	case int64(a.SrcIdx.Shape[0]) > a.X.Shape[0]:
		return goep.Argf("combine: src_idx has %d rows, x only %d", a.SrcIdx.Shape[0], a.X.Shape[0])
	}
	off, need := combineLayout(C, R, slots, rowBytes, a.NumTopk)
	if need > l.size {
		return tooSmall("combine", me, l.size, need, fmt.Sprintf("the rings of %d ranks x %d channels x %d slots of %d bytes (%d x %v, top-k %d) with %v",
			R, C, slots, rowBytes+4+4*a.NumTopk, a.Hidden, a.X.DType, a.NumTopk, configString(a.Config)))
	}
	vec := max(vecBytes(rowBytes, ptr(a.X), ptr(a.Bias0), ptr(a.Bias1), ptr(a.CombinedX)), int(es))
	if rowBytes%vec != 0 || ptr(a.X)%uint64(es) != 0 || ptr(a.CombinedX)%uint64(es) != 0 ||
		ptr(a.Bias0)%uint64(es) != 0 || ptr(a.Bias1)%uint64(es) != 0 {
		return goep.Argf("combine: x, bias and combined_x must be aligned to their %d-byte elements", es)
	}
	threads := int32(e.opts.Threads)
	key := kernelKey{kind: kindCombine, name: nameCombine, ranks: int32(R), a: int32(a.Hidden), b: dtype, c: int32(a.NumTopk),
		d: int32(vec), threads: threads}
	f, err := e.function(key, "intranode.cu", func() map[string]string {
		return CombineDefines(R, a.Hidden, int(dtype), a.NumTopk, vec, int(threads))
	})
	if err != nil {
		return err
	}
	if err := e.orderBefore(a.Order); err != nil {
		return err
	}
	if err := e.prologueFor(4, st, topo, peers, a.Config); err != nil {
		return err
	}
	p := &e.params.combine
	e.fillCtx(&p.Ctx, st, topo, peers, a.Config)
	p.X, p.Weights, p.SrcIdx, p.RankPrefix = ptr(a.X), ptr(a.TopkWeights), ptr(a.SrcIdx), ptr(a.RankPrefix)
	p.ChannelPrefix, p.SendHead, p.Bias0, p.Bias1 = ptr(a.ChannelPrefix), ptr(a.SendHead), ptr(a.Bias0), ptr(a.Bias1)
	p.Out, p.OutWeights = ptr(a.CombinedX), ptr(a.CombinedTopkWeights)
	p.OffRow, p.OffSrc, p.OffWeights = uint64(off[0]), uint64(off[1]), uint64(off[2])
	p.NumTokens, p.NumRows = int32(a.NumTokens), int32(a.X.Shape[0])
	if err := e.launch(f, uint32(2*C), uint32(threads), unsafe.Pointer(p)); err != nil {
		return err
	}
	return e.orderAfter(a.Order)
}
