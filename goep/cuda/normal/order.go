//go:build cgo

package cudanormal

import (
	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/env"
)

// The stream order: on which stream a call's kernels run, and what that stream waits for.
//
// DeepEP runs every kernel on its communication stream: before the call the comm stream waits
// for previous_event, or else for the caller's stream; after it the caller's stream waits for the
// comm stream, unless async_finish. For the usual call (no previous_event, async_finish=False,
// allocate_on_comm_stream=False) that is observably the same as queueing the kernels on the
// caller's stream itself: they start after what the caller queued before, and what it queues
// after starts after them. So the engine does that, and saves the two event records and two
// stream waits (about a microsecond each on a GPU host). The other calls run on the comm stream
// in DeepEP's order, as async_finish's event and allocate_on_comm_stream's tensors (Python's
// _finish, _empty) belong to it.
//
// What DeepEP's one stream also gave must be kept: the buffer's kernels never overlap one
// another (they share its region, its host-mapped records and its barrier numbers). The engine
// keeps the streams whose queue is behind all of the buffer's work (tails): a call whose stream
// is not one of them first makes it wait for one (an event record and a stream wait, as DeepEP's
// order costs), unless the call's own wait (for the caller's stream) covers it. So a usual call
// after a usual call on the same stream costs no order at all; after an async_finish call (on the
// comm stream) or on another caller stream than the last, one wait.
//
// What is synchronised when a call returns: the usual call's kernels are queued on the caller's
// stream, so its later work runs after them (DeepEP's join); a call with async_finish leaves them
// on the comm stream, where Python records the returned event. A dispatch's notify is waited for
// on the host either way (its counts).
//
// The trade-off: on the caller's stream the kernels run at that stream's priority, not at the
// comm stream's highest (which matters only where other streams' work competes for the SMs).
// PYEP_COMM_STREAM=1, read when the buffer's normal engine is made, keeps DeepEP's order for
// every call.
//
// Whatever the stream, the engine has queued all its work on the streams it names, so destroy's
// wait for the device (Close, cuCtxSynchronize) covers the caller's streams too. A caller stream
// that is one of the tails must stay a valid stream until the buffer's next call (the next call
// may record an event on it): PyTorch's streams are never destroyed. The per-thread default
// stream's handle (driver.StreamPerThread) names another stream on every thread, so calls on it
// take DeepEP's order and it is never a tail.
//
// The low-latency engine (goep/cuda/lowlatency) needs no order against these kernels: it runs
// over the buffer's RDMA region with records of its own, the normal kernels over the NVLink
// region, and its kernels run on the caller's stream, ordered against the normal ones by the
// caller's streams as any two kernels are.

// commStreamOnly is PYEP_COMM_STREAM=1, as set when an engine is made.
func commStreamOnly() bool { return env.CommStreamOnly() }

// tails are the streams whose queue ends behind every kernel the buffer has queued: the stream
// of its last call and, once that call joined, the caller's stream (n = 0: nothing queued yet).
type tails struct {
	n   int
	raw [2]uintptr
}

func (t *tails) has(raw uintptr) bool {
	for i := range t.n {
		if t.raw[i] == raw {
			return true
		}
	}
	return false
}

// onCaller reports whether a call runs on the caller's stream o.Stream: a call that joins that
// stream, with no previous_event and not allocate_on_comm_stream, and that either waits for it
// (the usual call) or needs no wait (a dispatch's data phase after its notify, DispatchRecv,
// whose order has no wait: it runs where the notify ran when that was this stream).
func (e *engine) onCaller(o goep.StreamOrder) bool {
	if e.commOnly || o.Event != 0 || o.Flags&(goep.OrderJoin|goep.OrderOnComm) != goep.OrderJoin ||
		o.Stream == driver.StreamPerThread {
		return false
	}
	return o.Flags&goep.OrderWait != 0 || e.tails.has(o.Stream)
}

// orderBefore picks the call's stream and queues what it must wait for there: previous_event or
// the caller's stream (DeepEP's order, on the comm stream), and the buffer's earlier work. Every
// call runs it before its first launch; the engine is locked and the context current, so the
// order costs no call of its own.
func (e *engine) orderBefore(o goep.StreamOrder) error {
	b := e.b
	s, covered := b.CommStream(), false // covered: the call's own wait covers the tails
	switch {
	case e.onCaller(o):
		s = b.WrapStream(o.Stream)
	case o.Event != 0:
		if err := s.WaitEvent(driver.WrapEvent(b.Driver(), o.Event)); err != nil {
			return err
		}
	case o.Flags&goep.OrderWait != 0:
		if err := b.StreamWaitEntered(s, b.WrapStream(o.Stream)); err != nil {
			return err
		}
		covered = e.tails.has(o.Stream)
	}
	if e.tails.n > 0 && !covered && !e.tails.has(s.Raw()) {
		if err := b.StreamWaitEntered(s, b.WrapStream(e.tails.raw[0])); err != nil {
			return err
		}
	}
	e.stream, e.ordered = s, true
	e.tails = tails{n: 1, raw: [2]uintptr{s.Raw()}}
	return nil
}

// orderAfter makes the caller's stream wait for the call's work, unless async_finish or the work
// ran there; the caller's stream is then behind the buffer's work too.
func (e *engine) orderAfter(o goep.StreamOrder) error {
	if o.Flags&goep.OrderJoin == 0 || o.Stream == e.stream.Raw() {
		return nil
	}
	if err := e.b.StreamWaitEntered(e.b.WrapStream(o.Stream), e.stream); err != nil {
		return err
	}
	if o.Stream != driver.StreamPerThread && e.tails.n == 1 {
		e.tails.raw[1], e.tails.n = o.Stream, 2
	}
	return nil
}
