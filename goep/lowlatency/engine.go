package lowlatency

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"
)

// DefaultTimeout bounds every wait on a peer when Domain.Timeout is zero.
const DefaultTimeout = 100 * time.Second

var (
	// ErrInvalid marks an argument error (the caller's); nothing was sent.
	ErrInvalid = errors.New("invalid argument")
	// ErrTimeout marks a peer that did not answer within the timeout, without enable_shrink.
	ErrTimeout = errors.New("timeout")
)

type opError struct {
	kind error
	msg  string
}

func (e *opError) Error() string { return e.msg }
func (e *opError) Unwrap() error { return e.kind }

func invalid(format string, args ...any) error {
	return &opError{ErrInvalid, fmt.Sprintf(format, args...)}
}

// Domain is the ranks that share low-latency regions: Regions[r] is rank r's region (NumBytes
// each) as this process addresses it.
type Domain struct {
	Rank, NumRanks int
	Regions        []unsafe.Pointer
	NumBytes       int64
	Timeout        time.Duration
	// Shrink (enable_shrink): a peer that does not answer in time is masked and the call goes
	// on without it; otherwise the call fails naming it.
	Shrink bool
	// Remote[p]: peer p is on another node (or allow_nvlink_for_low_latency_mode=False), and
	// this rank writes into its region only through remotePut and remoteSignal (remote.go).
	// nil: every peer is on this rank's node. Remote[Rank] is false.
	Remote []bool
}

// Engine is one rank's low-latency state: the calls since the last clean, the receives not yet
// finished, and the barrier epoch. Calls on one Engine must not run concurrently.
type Engine struct {
	d      Domain
	header Layout // R only: the header's offsets
	seq    uint32 // the latest call's sequence number (0: none since clean)
	shape  Shape  // the shape of the calls since clean (zero: none yet)
	epoch  uint64 // barriers passed
	// pending[h]: the receive of the call on half h that has not run yet (a hook).
	pending [2]*Recv
	// broken is why calls must wait for a clean (a peer timed out without shrink).
	broken   error
	timedOut []int
	// puts[p]: the remote puts to peer p that its next remoteSignal lands (remote.go).
	puts [][]put
}

// NewEngine checks d and makes rank d.Rank's engine.
func NewEngine(d Domain) (*Engine, error) {
	if d.NumRanks < 1 || d.Rank < 0 || d.Rank >= d.NumRanks || len(d.Regions) != d.NumRanks {
		return nil, invalid("low-latency domain: rank %d of %d with %d regions", d.Rank, d.NumRanks, len(d.Regions))
	}
	for r, p := range d.Regions {
		if p == nil || uintptr(p)%align != 0 {
			return nil, invalid("low-latency domain: region of rank %d is nil or not %d-byte aligned", r, align)
		}
	}
	if d.Remote != nil && (len(d.Remote) != d.NumRanks || d.Remote[d.Rank]) {
		return nil, invalid("low-latency domain: rank %d's path table has %d entries (expected %d) or makes the rank "+
			"remote to itself", d.Rank, len(d.Remote), d.NumRanks)
	}
	if d.NumBytes < HeaderBytes(d.NumRanks) {
		return nil, invalid("num_rdma_bytes = %d: low-latency mode needs at least %d", d.NumBytes, HeaderBytes(d.NumRanks))
	}
	if d.Timeout <= 0 {
		d.Timeout = DefaultTimeout
	}
	h, _ := NewLayout(d.NumRanks, Shape{MaxTokens: 1, Hidden: ScaleBlock, NumExperts: d.NumRanks})
	return &Engine{d: d, header: h, puts: make([][]put, d.NumRanks)}, nil
}

func (e *Engine) word(r int, off int64) *atomic.Uint64 {
	return (*atomic.Uint64)(at(e.d.Regions[r], off))
}

func (e *Engine) maskWord(p int) *atomic.Int32 {
	return (*atomic.Int32)(at(e.d.Regions[e.d.Rank], e.header.Mask(p)))
}

// SetTimeout bounds every later wait on a peer.
func (e *Engine) SetTimeout(d time.Duration) { e.d.Timeout = d }

// Masked reports whether rank p is masked on this rank.
func (e *Engine) Masked(p int) bool { return e.maskWord(p).Load() != 0 }

// SetMask masks (or unmasks) rank p on this rank (low_latency_update_mask_buffer).
func (e *Engine) SetMask(p int, mask bool) error {
	if p < 0 || p >= e.d.NumRanks {
		return invalid("rank_to_mask = %d: expected 0 <= rank_to_mask < num_ranks = %d", p, e.d.NumRanks)
	}
	v := int32(0)
	if mask {
		v = 1
	}
	e.maskWord(p).Store(v)
	return nil
}

// Masks writes 1 for every masked rank and 0 for the others (low_latency_query_mask_buffer).
func (e *Engine) Masks(out []int32) {
	for p := range out {
		out[p] = e.maskWord(p).Load()
	}
}

// CleanMasks unmasks every rank (low_latency_clean_mask_buffer).
func (e *Engine) CleanMasks() {
	for p := range e.d.NumRanks {
		e.maskWord(p).Store(0)
	}
}

// TimedOut returns, and forgets, the ranks masked because they timed out since the last call.
func (e *Engine) TimedOut() []int {
	t := e.timedOut
	e.timedOut = nil
	return t
}

// wait polls ready until it holds, or until the timeout; then, with shrink, it masks peer and
// returns false, and otherwise it fails naming the peer and what was awaited. It returns
// whether ready held and the time spent.
func (e *Engine) wait(peer int, what func() string, ready func() bool) (bool, time.Duration, error) {
	start := time.Now()
	for n := 0; ; n++ {
		if ready() {
			return true, time.Since(start), nil
		}
		if e.Masked(peer) {
			return false, time.Since(start), nil
		}
		switch {
		case n < 16:
		case n < 64:
			runtime.Gosched()
		default:
			sleepFor(time.Duration(min(n-63, 20)) * 5 * time.Microsecond)
		}
		if n%64 == 63 && time.Since(start) > e.d.Timeout {
			spent := time.Since(start)
			if e.d.Shrink {
				e.maskWord(peer).Store(1)
				e.timedOut = append(e.timedOut, peer)
				return false, spent, nil
			}
			e.broken = fmt.Errorf("rank %d timed out earlier", peer)
			return false, spent, &opError{ErrTimeout, fmt.Sprintf("rank %d: rank %d did not answer within %v (%s); "+
				"without enable_shrink the low-latency buffer needs clean_low_latency_buffer on every rank before the next "+
				"low-latency call", e.d.Rank, peer, e.d.Timeout, what())}
		}
	}
}

// SameShape checks that a call's shape s is prev, the shape of the calls since the last clean
// (zero: none yet): the flags and slots of every call lie where that shape's layout puts them.
func SameShape(op string, prev, s Shape) error {
	if prev != (Shape{}) && prev != s {
		return invalid("%s: num_max_dispatch_tokens_per_rank = %d, hidden = %d, num_experts = %d differ from the "+
			"previous low-latency calls' %d, %d, %d: call clean_low_latency_buffer on every rank before changing them", op,
			s.MaxTokens, s.Hidden, s.NumExperts, prev.MaxTokens, prev.Hidden, prev.NumExperts)
	}
	return nil
}

// begin starts call seq+1 with shape s: it checks that the engine is usable, that s is the
// shape of the calls since clean and fits, and that the receive of the call two back, on the
// same half, has finished here. It returns the layout, the half and the new seq.
func (e *Engine) begin(op string, s Shape) (Layout, int, uint32, error) {
	if e.broken != nil {
		return Layout{}, 0, 0, fmt.Errorf("%s: the low-latency buffer needs clean_low_latency_buffer on every rank first (%v)", op, e.broken)
	}
	l, err := NewLayout(e.d.NumRanks, s)
	if err == nil {
		err = l.Fits(e.d.NumBytes)
	}
	if err != nil {
		return Layout{}, 0, 0, err
	}
	if err := SameShape(op, e.shape, s); err != nil {
		return Layout{}, 0, 0, err
	}
	seq := e.seq + 1
	h := int(seq-1) % 2
	if e.pending[h] != nil {
		return Layout{}, 0, 0, invalid("%s: the receive hook of low-latency call %d (two calls back, same buffer half) has not "+
			"been called: at most two calls may await their hooks; call that hook first", op, e.pending[h].seq)
	}
	e.shape, e.seq = s, seq
	return l, h, seq, nil
}

// awaitAck waits until peer p has finished reading what call seq-2 left in half h of its
// region, before this rank writes there for call seq. It returns false if p is masked.
func (e *Engine) awaitAck(op string, l Layout, h int, seq uint32, p int) (bool, error) {
	if seq <= 2 || p == e.d.Rank {
		return !e.Masked(p), nil
	}
	ack := e.word(e.d.Rank, l.Ack(h, p))
	ok, _, err := e.wait(p, func() string {
		return fmt.Sprintf("%s: waiting for it to finish reading call %d's rows (half %d)", op, seq-2, h)
	}, func() bool { return ack.Load() >= uint64(seq-2) })
	return ok, err
}

// acknowledge tells every unmasked peer that this rank has finished reading half h for seq.
func (e *Engine) acknowledge(l Layout, h int, seq uint32) {
	for p := range e.d.NumRanks {
		if p != e.d.Rank && !e.Masked(p) {
			e.signal(p, l.Ack(h, e.d.Rank), uint64(seq))
		}
	}
}

func flag(seq uint32, v uint32) uint64 { return uint64(seq)<<32 | uint64(v) }

// barrier waits until every unmasked peer has reached this rank's next epoch.
func (e *Engine) barrier(op string) error {
	e.epoch++
	for p := range e.d.NumRanks {
		if p != e.d.Rank && !e.Masked(p) {
			e.signal(p, e.header.Sync(e.d.Rank), e.epoch)
		}
	}
	for p := range e.d.NumRanks {
		if p == e.d.Rank {
			continue
		}
		w := e.word(e.d.Rank, e.header.Sync(p))
		if _, _, err := e.wait(p, func() string { return op + ": barrier" }, func() bool { return w.Load() >= e.epoch }); err != nil {
			return err
		}
	}
	return nil
}

// Clean is clean_low_latency_buffer: after a barrier, it zeroes this rank's flags (dispatch,
// combine, done and push) and acks of shape s's layout, forgets the calls (seq 0) and their pending
// receives, and passes a second barrier, so that no peer writes for a new call before every
// rank has cleaned.
func (e *Engine) Clean(s Shape) error {
	l, err := NewLayout(e.d.NumRanks, s)
	if err == nil {
		err = l.Fits(e.d.NumBytes)
	}
	if err != nil {
		return err
	}
	e.broken = nil
	if err := e.barrier("clean_low_latency_buffer"); err != nil {
		return err
	}
	base := e.d.Regions[e.d.Rank]
	for h := range 2 {
		clear(unsafe.Slice((*byte)(at(base, l.DispatchFlags(h))), 2*l.FlagBytes+l.DoneBytes))
		clear(unsafe.Slice((*byte)(at(base, l.PushFlag(h, 0))), l.PushEntry(h, 0, 0, 0)-l.PushFlag(h, 0)))
		e.pending[h] = nil
	}
	clear(unsafe.Slice((*byte)(at(base, l.Ack(0, 0))), 16*e.d.NumRanks))
	e.seq, e.shape = 0, Shape{}
	return e.barrier("clean_low_latency_buffer")
}

// NextCombineBuffer is the offset of the send area that the next call uses: the rows [L][R*M][H]
// bf16 that a zero-copy combine sends.
func (e *Engine) NextCombineBuffer(s Shape) (int64, error) {
	l, err := NewLayout(e.d.NumRanks, s)
	if err == nil {
		err = l.Fits(e.d.NumBytes)
	}
	if err != nil {
		return 0, err
	}
	return l.Send(int(e.seq) % 2), nil
}

// Recv is the receive of a call whose send phase has run; Finish runs it once.
type Recv struct {
	e      *Engine
	seq    uint32
	half   int
	finish func() error
	done   bool
}

func (e *Engine) pend(h int, seq uint32, finish func() error) *Recv {
	r := &Recv{e: e, seq: seq, half: h, finish: finish}
	e.pending[h] = r
	return r
}

// Seq is the call's sequence number.
func (r *Recv) Seq() uint32 { return r.seq }

// Finish waits for every unmasked peer's rows of this call, copies them out and acknowledges
// them to the senders.
func (r *Recv) Finish() error {
	switch {
	case r.done:
		return invalid("the receive hook of low-latency call %d was already called", r.seq)
	case r.e.pending[r.half] != r:
		return invalid("the receive hook of low-latency call %d is stale: clean_low_latency_buffer ran since", r.seq)
	}
	r.done = true
	r.e.pending[r.half] = nil
	return r.finish()
}
