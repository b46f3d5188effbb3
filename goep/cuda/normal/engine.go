//go:build cgo

package cudanormal

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/dlpack"
)

// Normal mode on the GPU: every goep.Buffer has an engine of its own (NewEngine), which runs
// the kernels of kernels/layout.cu and kernels/intranode.cu (see intranode.cu for the memory
// layout and the protocol), compiled by NVRTC for this GPU and the call's shape and shared by
// every engine of the device (the cuda.Backend's kernel cache, goep/cuda/kernels.go).
//
// A call's kernels run on the caller's stream or on the backend's communication stream, as
// order.go says: the usual call (no previous_event, async_finish or allocate_on_comm_stream) on
// the caller's, the others on the comm stream in DeepEP's order. Notify waits on the host for the
// number of rows to receive (mapped host memory); layout, dispatch and combine only queue their
// kernels (layout's check of the expert indices is read by the next notify).
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

// bufferState is what the calls of one buffer share.
type bufferState struct {
	seq      uint64 // the next barrier number; every rank numbers alike
	dead     error  // set once a kernel failed: the buffer refuses work
	reported bool   // dead was returned once already

	errHost unsafe.Pointer // opError, host-mapped
	errDev  driver.DevicePtr
	resHost unsafe.Pointer // notifyResult + per-expert counts, host-mapped
	resDev  driver.DevicePtr
	resCap  int // per-expert counts resHost has room for

	notified   bool  // the last call was a successful notify: the dispatch after it needs no barriers of its own
	scratchOff int64 // where that notify's scratch starts
	perExpert  []int32
}

// engine is one buffer's normal mode on the GPU; its lock serialises the buffer's calls.
type engine struct {
	b    *cuda.Backend
	env  goep.EngineEnv
	mu   sync.Mutex
	opts cuda.NormalOptions // the device's, as of the call's start
	st   bufferState
	done bool // closed

	// The record of the last layout's bad index (u64 [4]: tag, token << 32 | choice, value),
	// written by the layout kernel and read by the next notify; layoutTag numbers the layouts.
	layoutHost unsafe.Pointer
	layoutDev  driver.DevicePtr
	layoutTag  uint64
	// The layout kernel's workspace (device memory), freed at Close.
	layoutWork driver.DevicePtr

	// Launch parameters, reused by every launch (a launch copies them), in an allocation of
	// their own that holds no Go pointer, as cgo requires of memory a C call reaches.
	params *launchParams

	// The stream order (order.go): the streams behind all of the buffer's work, the stream the
	// call in progress launches on (set by orderBefore, which every call runs before its first
	// launch), and PYEP_COMM_STREAM=1 as of the engine's making.
	tails    tails
	stream   driver.Stream
	ordered  bool // stream is set for the call in progress
	commOnly bool
}

type launchParams struct {
	// notify's and the dispatch's, launched apart or, for the queued dispatch, as one kernel's
	queued  notifyDispatchParams
	combine combineParams
	layout  layoutParams
}

var (
	_ goep.SpeculativeEngine = (*engine)(nil)
	_ goep.PerExpertCounter  = (*engine)(nil)
)

// NewEngine makes the normal-mode engine of one buffer on env.Backend's GPU, a *cuda.Backend:
// it is goep.Engines' Normal maker for cuda buffers (the composition root, goep/api, sets it).
func NewEngine(env goep.EngineEnv) (goep.NormalEngine, error) {
	b, err := cuda.BackendOf(env.Backend)
	if err != nil {
		return nil, err
	}
	return &engine{b: b, env: env, st: bufferState{seq: 1}, params: new(launchParams), commOnly: commStreamOnly()}, nil
}

// Close implements goep.Engine: once the GPU's work is done (bounded by the backend's timeout),
// it frees the buffer's host-mapped records, which queued kernels may still write.
func (e *engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.done {
		return nil
	}
	e.done = true
	if e.st.errHost == nil && e.st.resHost == nil && e.layoutHost == nil && e.layoutWork == 0 {
		return nil
	}
	b := e.b
	if err := b.SyncDevice(b.Timeout()); err != nil {
		return fmt.Errorf("pyep: cuda: closing the buffer's normal mode: %w; its records stay allocated", err)
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	var errs []error
	for _, p := range []unsafe.Pointer{e.st.errHost, e.st.resHost, e.layoutHost} {
		if p != nil {
			errs = append(errs, b.Driver().MemFreeHost(p))
		}
	}
	e.st.errHost, e.st.resHost, e.layoutHost = nil, nil, nil
	if e.layoutWork != 0 {
		errs = append(errs, b.Driver().MemFree(e.layoutWork))
	}
	e.layoutWork = 0
	return errors.Join(errs...)
}

// begin locks the engine, enters the context and takes the device's options; end undoes the
// first two.
func (e *engine) begin() (end func(), err error) {
	e.mu.Lock()
	if e.done {
		e.mu.Unlock()
		return func() {}, errors.New("pyep: the buffer was destroyed")
	}
	exit, err := e.b.Enter()
	if err != nil {
		exit()
		e.mu.Unlock()
		return func() {}, err
	}
	e.opts = e.b.NormalOptions()
	e.ordered = false
	return func() { exit(); e.mu.Unlock() }, nil
}

// enterBuffer begins a call that uses the buffer's protocol: the engine locked, the context
// entered, the buffer's state (its error record allocated), whether the call before was a
// successful notify (cleared now), and the buffer's recorded failure if it has one. end undoes
// begin, also after an error.
func (e *engine) enterBuffer() (end func(), st *bufferState, notified bool, err error) {
	if end, err = e.begin(); err != nil {
		return end, nil, false, err
	}
	st = &e.st
	if st.errHost == nil {
		if st.errHost, st.errDev, err = e.b.HostAlloc(opErrorBytes); err != nil {
			return end, nil, false, err
		}
	}
	notified, st.notified = st.notified, false
	return end, st, notified, e.usable(st)
}

// usable reports a failure recorded by an earlier kernel of the buffer.
func (e *engine) usable(st *bufferState) error {
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
func (e *engine) recorded(st *bufferState) error {
	rec := (*opError)(st.errHost)
	if atomic.LoadUint32(opErrorCode(rec)) == 0 {
		return nil
	}
	r := *rec
	return errors.New(describeFailure(&r) + "; the buffer is unusable from now on: destroy it and make a new one")
}

// launch queues f on the call's stream (orderBefore's) with one parameter struct.
func (e *engine) launch(f driver.Function, grid, block uint32, params unsafe.Pointer) error {
	if !e.ordered {
		return fmt.Errorf("pyep: internal error: kernel %s launched before its call's stream order", f.Name())
	}
	if err := e.b.Launch(f, grid, block, e.stream, params); err != nil {
		return err
	}
	if debugSync {
		if err := e.stream.Synchronize(); err != nil {
			return fmt.Errorf("pyep: kernel %s failed: %w; launch parameters: %#v", f.Name(), err, *e.params)
		}
	}
	return nil
}

// ptr is a tensor's device address (0 for an absent tensor).
func ptr(t dlpack.Tensor) uint64 {
	if !t.Valid {
		return 0
	}
	return uint64(uintptr(t.Data))
}

// fillCtx sets the parts of ctx every kernel of a call shares.
func (e *engine) fillCtx(ctx *kctx, st *bufferState, topo goep.Topology, peers []goep.Region, cfg goep.Config) {
	for i := range ctx.data {
		ctx.data[i], ctx.ctl[i] = 0, 0
	}
	for i, p := range peers {
		ctx.data[i] = u64(uint64(cuda.PtrOf(p.Data())))
		ctx.ctl[i] = u64(uint64(cuda.PtrOf(p.Control())))
	}
	headOff, total := counters(cfg.NumChannels(), topo.NumNVLRanks)
	ctx.err = u64(uint64(st.errDev))
	ctx.seq = u64(st.seq)
	ctx.timeout_ns = u64(goep.OpTimeout().Nanoseconds())
	ctx.counter_bytes = u64(total)
	ctx.head_off = u64(headOff)
	ctx.rank = i32(topo.NVLRank)
	ctx.num_channels = i32(cfg.NumChannels())
	ctx.ring_slots = i32(cfg.NumMaxNVLChunkedRecvTokens)
	ctx.chunk = i32(cfg.NumMaxNVLChunkedSendTokens)
}

// hostGrace is how much longer than the kernels' own bound the host waits for a result before
// it gives up on the GPU (the kernel may have started late, behind other work).
const hostGrace = 5 * time.Second

// spinFor is how long waitHost polls without sleeping.
const spinFor = 20 * time.Millisecond

// waitHost polls the u64 at tag until it holds want: the answer of a kernel the call queued on
// its stream. It gives up when the buffer's error record fills (st != nil), the stream fails, or
// the kernels' timeout plus a grace passes.
func (e *engine) waitHost(tag *uint64, want uint64, st *bufferState, what string) error {
	stream, which := e.b.CommStream(), "the communication stream"
	if e.ordered && e.stream.Raw() != stream.Raw() {
		stream, which = e.stream, "the caller's stream"
	}
	limit := goep.OpTimeout() + hostGrace
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
			if _, err := stream.Query(); err != nil {
				return fmt.Errorf("pyep: %s: %s failed: %w", what, which, err)
			}
			if time.Since(start) > limit {
				return fmt.Errorf("pyep: %s: no answer from the GPU within %v (%s is stuck behind other work, or a kernel hangs)", what, limit, which)
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
