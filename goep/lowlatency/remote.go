package lowlatency

import (
	"fmt"
	"unsafe"
)

// How a rank writes into a peer's region. A peer on this rank's node (one NVLink domain) is
// written directly: the rows with plain copies through the mapped region, then the flag with an
// atomic store, which orders the copies before it. A peer on another node (Domain.Remote) is
// written only through remotePut and remoteSignal, the two operations that NVSHMEM gives a GPU
// (nvshmem put, then a signal with NVSHMEM_SIGNAL_SET), with this contract, which the GPU
// version of the pair (kernels/low_latency.cu) keeps:
//
//   - remotePut(dst, off, src) starts copying src into dst's region at off. Nothing about those
//     bytes may be assumed, by the sender or by dst, until dst has seen a later signal of this
//     rank: the copy may land at any time before that signal, in any order with this rank's
//     other puts, and puts to one destination never overlap. src stays unchanged until then
//     (on the GPU: until the put has completed, nvshmem_quiet, since an nbi put reads its
//     source late; the send area of half h is rewritten by call n+2).
//   - remoteSignal(dst, off, v) stores the 8-byte word v at off in dst's region, after every
//     byte of this rank's earlier puts to dst has landed (release: nvshmem_fence, or
//     nvshmemx_signal_op after the puts, or put-with-signal). A whole-word set, never torn,
//     never an add. Nothing is ordered between destinations, and the sender learns nothing about
//     delivery from it.
//   - dst reads its own region only: it polls the word with an acquire load, and once the load
//     returns v (a flag's seq), every byte that this rank put to dst before the signal is
//     visible to it. Ranks never read a peer's region (no gets), and every peer's writes into a
//     region go to areas that the protocol gives that peer (its slots, its flags, its ack and
//     sync words), so the receive side is the same whichever way a peer was reached.
//
// On the cpu backend every region is host memory that this process maps, so the pair emulates
// the delivery: remotePut only records the copy, and remoteSignal makes every recorded copy to
// dst, newest first, then stores the word. An engine that relied on a put before its signal
// (or that forgot a signal) would read stale bytes or none, and the tests would see it. The
// results are bit for bit those of direct writes: the same bytes land at the same offsets
// before the same flags.

// put is a copy that remotePut recorded and the next remoteSignal to its peer makes.
type put struct {
	off int64
	src []byte
}

// remote reports whether peer p is reached through remotePut and remoteSignal.
func (e *Engine) remote(p int) bool { return e.d.Remote != nil && e.d.Remote[p] }

// write puts src at off into dst's region: directly within the node, else through remotePut.
func (e *Engine) write(dst int, off int64, src []byte) {
	if e.remote(dst) {
		e.remotePut(dst, off, src)
		return
	}
	copy(unsafe.Slice((*byte)(at(e.d.Regions[dst], off)), len(src)), src)
}

// signal stores v at off in dst's region after every earlier write to dst (release): an atomic
// store within the node, else remoteSignal.
func (e *Engine) signal(dst int, off int64, v uint64) {
	if e.remote(dst) {
		e.remoteSignal(dst, off, v)
		return
	}
	e.word(dst, off).Store(v)
}

// remotePut records the copy of src to off in dst's region; see the contract above.
func (e *Engine) remotePut(dst int, off int64, src []byte) {
	e.puts[dst] = append(e.puts[dst], put{off: off, src: src})
}

// remoteSignal lands every recorded put to dst, then stores v at off in dst's region (the
// atomic store orders the copies before it, as the fence does on the GPU).
func (e *Engine) remoteSignal(dst int, off int64, v uint64) {
	puts, region := e.puts[dst], e.d.Regions[dst]
	for i := len(puts) - 1; i >= 0; i-- {
		p := puts[i]
		copy(unsafe.Slice((*byte)(at(region, p.off)), len(p.src)), p.src)
	}
	clear(puts)
	e.puts[dst] = puts[:0]
	e.word(dst, off).Store(v)
}

// unsignalled is the error of a send phase that left puts without their signal: a bug of the
// engine, which the receiver would wait on until its timeout.
func (e *Engine) unsignalled(op string) error {
	for dst, puts := range e.puts {
		if len(puts) > 0 {
			clear(puts)
			e.puts[dst] = puts[:0]
			return fmt.Errorf("%s: pyep internal error: %d puts to rank %d without a signal after them", op, len(puts), dst)
		}
	}
	return nil
}
