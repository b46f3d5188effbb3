package normal

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"
)

// MaxRanks is the largest NVLink domain the package supports.
const MaxRanks = 8

// ControlBytes is the size of every rank's control region. The package owns
// all of it; only the first few hundred bytes are used today.
const ControlBytes = 4096

// DefaultTimeout bounds every wait when Domain.Timeout is zero.
const DefaultTimeout = 100 * time.Second

// Domain is one rank's view of the NVLink domain's shared memory.
//
// Buffers[r] and Controls[r] are peer r's data and control regions as mapped
// in this process. Both must be zeroed when first allocated and 8-byte
// aligned (page aligned in practice). A Domain holds no state of its own:
// everything the protocol remembers between calls lives in the regions.
type Domain struct {
	Rank, NumRanks int              // this rank's index in the domain, domain size (1..8)
	Buffers        []unsafe.Pointer // Buffers[r]: peer r's data region, NumBytes long, zeroed at allocation
	Controls       []unsafe.Pointer // Controls[r]: peer r's control region, ControlBytes long, zeroed at allocation
	NumBytes       int64            // size of every data region (num_nvl_bytes, multiple of 128)
	Timeout        time.Duration    // every wait gives up after this; 0 means 100s

	// Workers is the number of goroutines a dispatch or combine uses on this
	// rank; 0 means min(channels, GOMAXPROCS). Each worker serves whole
	// channels (their send and receive sides) without ever blocking on one
	// ring, so any count is deadlock free.
	Workers int
}

// Errors returned by the package wrap one of these, so callers can map them
// to exception types with errors.Is.
var (
	// ErrInvalid: an argument (or the domain, or the buffer size) is wrong.
	ErrInvalid = errors.New("invalid argument")
	// ErrTimeout: a wait on a peer exceeded Domain.Timeout.
	ErrTimeout = errors.New("timed out")
	// ErrPeer: a peer failed or left the call, or called something else.
	ErrPeer = errors.New("peer failure")
)

type opError struct {
	msg  string
	kind error
}

func (e *opError) Error() string { return e.msg }
func (e *opError) Unwrap() error { return e.kind }

func newErr(kind error, format string, args ...any) error {
	return &opError{msg: fmt.Sprintf(format, args...), kind: kind}
}

// Control region layout (byte offsets). Every field is a 64-bit word written
// with sync/atomic by the owning rank only, except the decision word, which
// lives in rank 0's region and is changed by any rank with compare-and-swap.
const (
	ctlState    = 0   // gen<<8 | phase of the owner's current or last call
	ctlDecision = 8   // rank 0 only: gen<<16 | present<<8 | decider<<4 | outcome
	ctlDesc     = 64  // descWords words: op and the call's shape, for mismatch checks
	descWords   = 8   //
	ctlMsgLen   = 128 // length of the failure text below
	ctlMsg      = 136 // msgWords words of failure text of the owner's failed call
	msgWords    = 47  // 376 bytes
	ctlUsed     = ctlMsg + 8*msgWords
)

// Phases of a rank's state word.
const (
	phIdle   = 0 // never called (zeroed region)
	phJoin   = 1 // entered the call, proposing its generation
	phReady  = 2 // generation committed, own counters zeroed
	phDone   = 3 // left the call successfully
	phFailed = 4 // left the call with an error (text in ctlMsg)
)

// Outcomes in the decision word.
const (
	outCommitted = 0
	outAborted   = 1
)

func packState(gen uint64, phase uint64) uint64 { return gen<<8 | phase }
func stateGen(w uint64) uint64                  { return w >> 8 }
func statePhase(w uint64) uint64                { return w & 0xff }

// packDecision: present is the mask of ranks that had entered the
// generation when it was decided (all of them for a commit).
func packDecision(gen uint64, decider int, outcome, present uint64) uint64 {
	return gen<<16 | present<<8 | uint64(decider)<<4 | outcome
}
func decisionGen(w uint64) uint64     { return w >> 16 }
func decisionPresent(w uint64) uint64 { return w >> 8 & 0xff }
func decisionRank(w uint64) int       { return int(w>>4) & 0xf }
func decisionOutcome(w uint64) uint64 { return w & 0xf }

func phaseName(w uint64) string {
	switch statePhase(w) {
	case phIdle:
		return "idle"
	case phJoin:
		return fmt.Sprintf("joining call #%d", stateGen(w))
	case phReady:
		return fmt.Sprintf("in call #%d", stateGen(w))
	case phDone:
		return fmt.Sprintf("idle after call #%d", stateGen(w))
	case phFailed:
		return fmt.Sprintf("idle after failing call #%d", stateGen(w))
	}
	return fmt.Sprintf("in unknown state %#x", w)
}

// word returns the 64-bit word at byte offset off of base as an atomic.
func word(base unsafe.Pointer, off int64) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Add(base, off))
}

func (d *Domain) ctl(r int, off int64) *atomic.Uint64 { return word(d.Controls[r], off) }

func (d *Domain) timeout() time.Duration {
	if d.Timeout <= 0 {
		return DefaultTimeout
	}
	return d.Timeout
}

// check validates the domain description itself. Errors here are returned
// without touching shared memory: there is nothing safe to touch.
func (d *Domain) check(op string) error {
	if d == nil {
		return newErr(ErrInvalid, "%s: domain is nil", op)
	}
	if d.NumRanks < 1 || d.NumRanks > MaxRanks {
		return newErr(ErrInvalid, "%s: num_ranks = %d, must be in [1, %d]", op, d.NumRanks, MaxRanks)
	}
	if d.Rank < 0 || d.Rank >= d.NumRanks {
		return newErr(ErrInvalid, "%s: rank = %d is out of range [0, %d)", op, d.Rank, d.NumRanks)
	}
	if len(d.Buffers) != d.NumRanks || len(d.Controls) != d.NumRanks {
		return newErr(ErrInvalid, "%s: rank %d: domain has %d data and %d control regions for %d ranks",
			op, d.Rank, len(d.Buffers), len(d.Controls), d.NumRanks)
	}
	if d.NumBytes < 0 {
		return newErr(ErrInvalid, "%s: rank %d: num_nvl_bytes = %d is negative", op, d.Rank, d.NumBytes)
	}
	for r := 0; r < d.NumRanks; r++ {
		if d.Controls[r] == nil || uintptr(d.Controls[r])%8 != 0 {
			return newErr(ErrInvalid, "%s: rank %d: control region of rank %d is nil or not 8-byte aligned", op, d.Rank, r)
		}
		if d.NumBytes > 0 && (d.Buffers[r] == nil || uintptr(d.Buffers[r])%8 != 0) {
			return newErr(ErrInvalid, "%s: rank %d: data region of rank %d is nil or not 8-byte aligned", op, d.Rank, r)
		}
	}
	return nil
}

// backoff paces a polling loop: a few bare re-checks (a peer on another core
// usually answers within that), then yields to other goroutines, then short
// sleeps growing to 100µs, so that up to 8 rank processes on a 2-core machine
// do not starve the rank they are waiting for.
type backoff struct {
	n     int
	sleep time.Duration
}

const (
	spinRounds  = 16
	yieldRounds = 48
	maxSleep    = 100 * time.Microsecond
)

func (b *backoff) reset() { b.n = 0 }

// slow reports whether pause has passed the spinning stage; callers do their
// expensive checks (clock, peer states) only then.
func (b *backoff) slow() bool { return b.n > spinRounds }

func (b *backoff) pause() {
	b.n++
	switch {
	case b.n <= spinRounds:
	case b.n <= yieldRounds:
		runtime.Gosched()
	default:
		if b.n == yieldRounds+1 {
			b.sleep = 5 * time.Microsecond
		}
		sleepFor(b.sleep)
		if b.sleep < maxSleep {
			b.sleep *= 2
		}
	}
}

// opKind identifies the operation in the published call description.
type opKind uint64

const (
	opBarrier opKind = iota + 1
	opNotify
	opDispatch
	opCombine
)

var opNames = map[opKind]string{opBarrier: "barrier", opNotify: "notify", opDispatch: "dispatch", opCombine: "combine"}

// desc is what a rank publishes about its call so that peers can detect a
// mismatched call (another operation, or another shape) instead of
// exchanging garbage. Field names are for error messages only.
type desc struct {
	op      opKind
	invalid bool // this rank's arguments failed validation; skip comparisons
	names   []string
	vals    []uint64
}

// call is one rank's state of one collective call.
type call struct {
	d       *Domain
	op      string // name used in messages ("dispatch", "barrier(tag)")
	desc    desc
	gen     uint64
	me, R   int
	timeout time.Duration
}

func (c *call) errf(kind error, format string, args ...any) error {
	return newErr(kind, "%s: rank %d: "+format, append([]any{c.op, c.me}, args...)...)
}

// chErrf is errf for an error of one channel.
func (c *call) chErrf(ch int, kind error, format string, args ...any) error {
	return newErr(kind, "%s: rank %d channel %d: "+format, append([]any{c.op, c.me, ch}, args...)...)
}

func (c *call) state(r int) uint64 { return c.d.ctl(r, ctlState).Load() }

// enter joins a new call: it publishes the call description, proposes the
// next generation and waits until the generation is decided (see the package
// documentation). On success the generation is committed and every rank has
// entered it.
func (d *Domain) enter(op string, ds desc) (*call, error) {
	c := &call{d: d, op: op, desc: ds, me: d.Rank, R: d.NumRanks, timeout: d.timeout()}
	me := c.me
	hdr := uint64(ds.op)
	if ds.invalid {
		hdr |= 1 << 8
	}
	d.ctl(me, ctlDesc).Store(hdr)
	for i := 0; i < descWords-1; i++ {
		var v uint64
		if i < len(ds.vals) {
			v = ds.vals[i]
		}
		d.ctl(me, ctlDesc+8*int64(i+1)).Store(v)
	}

	dec := d.ctl(0, ctlDecision)
	g := max(decisionGen(dec.Load()), stateGen(c.state(me))) + 1
	c.gen = g
	d.ctl(me, ctlState).Store(packState(g, phJoin))

	full := uint64(1)<<c.R - 1
	var b backoff
	start := time.Now()
	for {
		dv := dec.Load()
		if dg := decisionGen(dv); dg >= g {
			if dg == g && decisionOutcome(dv) == outCommitted {
				break
			}
			if dg == g && decisionPresent(dv)&(1<<me) != 0 {
				err := c.errf(ErrTimeout, "call #%d was aborted: rank %d timed out waiting for %s to join",
					g, decisionRank(dv), c.ranksOutside(decisionPresent(dv)))
				c.leave(err)
				return nil, err
			}
			// The generation was decided without us: this call belongs to
			// the next one, which the peers' next call will propose too.
			g = dg + 1
			c.gen = g
			d.ctl(me, ctlState).Store(packState(g, phJoin))
			b.reset()
			start = time.Now()
			continue
		}
		present := uint64(1) << me
		for p := 0; p < c.R; p++ {
			if stateGen(c.state(p)) == g {
				present |= 1 << p
			}
		}
		if present == full {
			if dec.CompareAndSwap(dv, packDecision(g, me, outCommitted, present)) {
				break
			}
			continue
		}
		b.pause()
		if b.slow() && time.Since(start) > c.timeout {
			// Abort the generation unless a peer decided it meanwhile, in
			// which case the loop re-reads the decision. The ranks present
			// now fail; any other rank's call moves to the next generation.
			if dec.CompareAndSwap(dv, packDecision(g, me, outAborted, present)) {
				err := c.errf(ErrTimeout, "timed out after %v waiting for %s to join call #%d",
					c.timeout, c.ranksOutside(present), g)
				c.leave(err)
				return nil, err
			}
		}
	}
	if err := c.checkPeerDescs(); err != nil {
		c.leave(err)
		return nil, err
	}
	return c, nil
}

// ranksOutside names the ranks not in the present mask, with their state.
func (c *call) ranksOutside(present uint64) string {
	var parts []string
	for p := 0; p < c.R; p++ {
		if present&(1<<p) == 0 {
			parts = append(parts, fmt.Sprintf("rank %d (%s)", p, phaseName(c.state(p))))
		}
	}
	if len(parts) == 0 {
		return "no rank"
	}
	return strings.Join(parts, ", ")
}

// checkPeerDescs compares the peers' call descriptions with ours. A peer that
// already moved on is skipped: it cannot finish this call without us, so it
// failed and later waits report it.
func (c *call) checkPeerDescs() error {
	if c.desc.invalid {
		return nil
	}
	var vals [descWords]uint64
	for p := 0; p < c.R; p++ {
		if p == c.me {
			continue
		}
		s := c.state(p)
		if stateGen(s) != c.gen {
			continue
		}
		for i := range vals {
			vals[i] = c.d.ctl(p, ctlDesc+8*int64(i)).Load()
		}
		if stateGen(c.state(p)) != c.gen || vals[0]&(1<<8) != 0 {
			continue
		}
		if peerOp := opKind(vals[0] & 0xff); peerOp != c.desc.op {
			name := opNames[peerOp]
			if name == "" {
				name = fmt.Sprintf("op %d", peerOp)
			}
			return c.errf(ErrPeer, "rank %d called %s in call #%d while this rank called %s (all ranks must make the same sequence of calls)",
				p, name, c.gen, opNames[c.desc.op])
		}
		for i, name := range c.desc.names {
			if vals[i+1] != c.desc.vals[i] {
				return c.errf(ErrPeer, "rank %d called %s with %s = %d, this rank with %d (call #%d)",
					p, opNames[c.desc.op], name, int64(vals[i+1]), int64(c.desc.vals[i]), c.gen)
			}
		}
	}
	return nil
}

// ready publishes that this rank has zeroed its counters for the call and
// waits until every rank has.
func (c *call) ready() error {
	c.d.ctl(c.me, ctlState).Store(packState(c.gen, phReady))
	for p := 0; p < c.R; p++ {
		if p == c.me {
			continue
		}
		err := c.wait(p, func() bool {
			s := c.state(p)
			return stateGen(s) == c.gen && (statePhase(s) == phReady || statePhase(s) == phDone)
		}, func() string { return "finish zeroing its counters" })
		if err != nil {
			return err
		}
	}
	return nil
}

// leave ends the call: on error the text is published for the peers first.
func (c *call) leave(err error) {
	if err == nil {
		c.d.ctl(c.me, ctlState).Store(packState(c.gen, phDone))
		return
	}
	msg := err.Error()
	if len(msg) > 8*msgWords {
		msg = msg[:8*msgWords]
	}
	var words [msgWords]uint64
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), 8*msgWords), msg)
	for i, w := range words {
		c.d.ctl(c.me, ctlMsg+8*int64(i)).Store(w)
	}
	c.d.ctl(c.me, ctlMsgLen).Store(uint64(len(msg)))
	c.d.ctl(c.me, ctlState).Store(packState(c.gen, phFailed))
}

// peerMessage reads the failure text of peer p for this call, or "" if p has
// moved on and the text may already belong to a later call.
func (c *call) peerMessage(p int) string {
	s := c.state(p)
	if s != packState(c.gen, phFailed) {
		return ""
	}
	n := min(int(c.d.ctl(p, ctlMsgLen).Load()), 8*msgWords)
	var words [msgWords]uint64
	for i := range words {
		words[i] = c.d.ctl(p, ctlMsg+8*int64(i)).Load()
	}
	if c.state(p) != s {
		return ""
	}
	return string(unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), 8*msgWords)[:n])
}

// peerFailed returns the error of the lowest rank that failed this call.
func (c *call) peerFailed() error {
	for p := 0; p < c.R; p++ {
		if p == c.me {
			continue
		}
		if s := c.state(p); s == packState(c.gen, phFailed) {
			if msg := c.peerMessage(p); msg != "" {
				return c.errf(ErrPeer, "rank %d failed call #%d: %s", p, c.gen, msg)
			}
			return c.errf(ErrPeer, "rank %d failed call #%d", p, c.gen)
		}
	}
	return nil
}

// peerLeft reports whether peer p has left this call (successfully or not):
// waiting on it can then only end by timeout.
func (c *call) peerLeft(p int) bool {
	s := c.state(p)
	return stateGen(s) > c.gen || (stateGen(s) == c.gen && statePhase(s) >= phDone)
}

// wait polls ready until it holds, bounded by the timeout, giving up early
// when a peer failed or when peer p (the one awaited) left the call.
func (c *call) wait(p int, ready func() bool, what func() string) error {
	if ready() {
		return nil
	}
	var b backoff
	start := time.Now()
	left := false
	for {
		b.pause()
		if ready() {
			return nil
		}
		if !b.slow() {
			continue
		}
		if err := c.peerFailed(); err != nil {
			return err
		}
		if left { // p had left before the last check of ready
			return c.errf(ErrPeer, "rank %d left call #%d (%s) while this rank was waiting for it to %s",
				p, c.gen, phaseName(c.state(p)), what())
		}
		left = c.peerLeft(p)
		if time.Since(start) > c.timeout {
			return c.errf(ErrTimeout, "timed out after %v waiting for rank %d to %s", c.timeout, p, what())
		}
	}
}

// run is the skeleton of every collective call: join, (on invalid local
// arguments: fail the call so that peers learn why at once), zero own
// counters, wait for everybody, do the work, leave.
func (d *Domain) run(op string, ds desc, invalid error, zero func(), body func(c *call) error) error {
	if err := d.check(op); err != nil {
		return err
	}
	ds.invalid = invalid != nil
	c, err := d.enter(op, ds)
	if err != nil {
		if invalid != nil {
			return invalid
		}
		return err
	}
	if invalid != nil {
		c.leave(invalid)
		return invalid
	}
	if zero != nil {
		zero()
		if err := c.ready(); err != nil {
			c.leave(err)
			return err
		}
	}
	if body != nil {
		if testHook != nil {
			testHook(c, "body")
		}
		err = body(c)
	}
	var v verdict
	if errors.As(err, &v) {
		// Every rank reaches this error by itself: leave normally, so that
		// peers still computing get their own (identical) verdict.
		c.leave(nil)
		return v.err
	}
	if err == nil {
		// A peer that already failed this call makes it fail here too, so
		// that ranks agree on the outcome whenever the timing allows it.
		err = c.peerFailed()
	}
	c.leave(err)
	return err
}

// verdict wraps an error that every rank derives identically from data all
// ranks share (such as num_worst_tokens being too small); it is not
// propagated as a peer failure.
type verdict struct{ err error }

func (v verdict) Error() string { return v.err.Error() }

// testHook, when set by a test, is called at fixed points of a call ("body":
// before the work; "worker": when a worker starts) to simulate slow ranks.
var testHook func(c *call, where string)

// Barrier returns once every rank of the domain has called Barrier (it is a
// collective call like any other: it consumes a generation). On timeout the
// error names the ranks that did not arrive; tag only labels messages.
func Barrier(d *Domain, tag string) error {
	op := "barrier"
	if tag != "" {
		op = fmt.Sprintf("barrier(%s)", tag)
	}
	return d.run(op, desc{op: opBarrier}, nil, nil, nil)
}
