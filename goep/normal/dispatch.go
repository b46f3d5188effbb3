package normal

import (
	"fmt"
	"sync/atomic"
	"unsafe"
)

// DispatchArgs are the arguments of Dispatch. Slices alias caller (Python)
// memory: inputs are read, outputs written; nothing is retained after the
// call. Token payloads are opaque bytes.
//
// A cached dispatch (reusing the handle of an earlier dispatch) leaves
// NumTopk, TopkIdx, TopkWeights and their outputs empty; then only x and
// its scales move.
type DispatchArgs struct {
	Config      Config
	NumTokens   int // T: tokens on this rank
	HiddenBytes int // bytes per row of X (2*hidden for BF16, hidden for FP8, ...)
	ScalesBytes int // bytes per row of XScales, 0 without scales
	NumTopk     int // K, 0 for a cached dispatch
	NumExperts  int // E, needed when NumTopk > 0 (global -> local expert indices)
	// Strided scales: scale j of token t is the 4-byte word t*ScalesTokenStride + j*ScalesStride
	// of XScales (column-major ones are (1, T)). Both 0: rows of ScalesBytes, back to back.
	ScalesTokenStride, ScalesStride int

	X             []byte    // [T, HiddenBytes]
	XScales       []byte    // [T, ScalesBytes], or the words strided scales span; nil without
	TopkIdx       []int64   // [T, K] global expert indices, -1 for none
	TopkWeights   []float32 // [T, K]
	IsTokenInRank []bool    // [T, R]

	// From Notify (or the cached handle).
	RankPrefixMatrix []int32 // [R, R]
	// Optional: if set it is checked against IsTokenInRank.
	ChannelPrefixMatrix []int32 // [R, C] sender side, inclusive prefix

	// NumWorstTokens > 0: the outputs have NumWorstTokens rows, of which
	// the first RankPrefixMatrix[R-1][Rank] are real and the rest padding
	// (x and scales zero, src_idx -1, topk_idx -1, weights 0).
	NumWorstTokens int

	RecvX           []byte    // out [N, HiddenBytes], N = NumWorstTokens or the received rows
	RecvXScales     []byte    // out [N, ScalesBytes] when ScalesBytes > 0
	RecvSrcIdx      []int32   // out [N] or nil: source token index
	RecvTopkIdx     []int64   // out [N, K] when K > 0: local expert index or -1
	RecvTopkWeights []float32 // out [N, K] when K > 0: weight where the index is not -1, else 0
	// Optional outputs.
	RecvChannelPrefixMatrix []int32 // out [R, C]: exclusive prefix of what each source sends per channel
	SendHead                []int32 // out [T, R]: index of t in its (channel, dst) stream, -1 if not sent
}

// Dispatch moves every token t of every rank to each rank dst with
// IsTokenInRank[t][dst], through rings in the receivers' data regions (a
// rank's tokens for itself go straight into its rows, as in the kernel). On
// the receiver, rows are ordered by source rank, then source token index:
// row = RankPrefixMatrix[src-1][me] + (offset of the channel within src's
// block) + (position within the channel's stream).
func Dispatch(d *Domain, a *DispatchArgs) error {
	const op = "dispatch"
	if err := d.check(op); err != nil {
		return err
	}
	R, me := d.NumRanks, d.Rank
	C := a.Config.NumChannels()
	numRecv, numOut, invalid := a.validate(d)
	var counts []int64
	var lay ringLayout
	if invalid == nil {
		counts = sendCounts(a.IsTokenInRank, a.NumTokens, R, C)
		invalid = checkSendPrefix(op, me, a.ChannelPrefixMatrix, counts, R, C)
	}
	if invalid == nil {
		lay = dispatchLayout(a.Config, R, a.HiddenBytes, a.ScalesBytes, a.NumTopk)
		invalid = checkBuffer(op, d, lay.total, fmt.Sprintf(
			"%d ranks x %d channels x %d slots of %d bytes (hidden %d, scales %d, top-k %d) with config %v",
			R, C, a.Config.NumMaxNVLChunkedRecvTokens, 4+12*a.NumTopk+a.ScalesBytes+a.HiddenBytes,
			a.HiddenBytes, a.ScalesBytes, a.NumTopk, a.Config))
	}
	ds := desc{op: opDispatch,
		names: []string{"num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
			"hidden_bytes", "scales_bytes", "num_topk", "num_experts"},
		vals: []uint64{uint64(a.Config.NumSMs), uint64(a.Config.NumMaxNVLChunkedSendTokens), uint64(a.Config.NumMaxNVLChunkedRecvTokens),
			uint64(a.HiddenBytes), uint64(a.ScalesBytes), uint64(a.NumTopk), uint64(a.NumExperts)}}
	if a.NumTopk == 0 {
		ds.vals[6] = 0 // a cached dispatch does not need num_experts
	}
	zero := func() { zeroRings(d.Buffers[me], &lay) }
	body := func(c *call) error {
		recvCounts, err := exchangeCounts(c, &lay, counts)
		if err != nil {
			return err
		}
		// Row of the first token of every (channel, src) stream.
		rows := make([]int64, C*R)
		for src := 0; src < R; src++ {
			var base int64
			if src > 0 {
				base = int64(a.RankPrefixMatrix[(src-1)*R+me])
			}
			block := int64(a.RankPrefixMatrix[src*R+me]) - base
			var run int64
			for ch := 0; ch < C; ch++ {
				rows[ch*R+src] = base + run
				if a.RecvChannelPrefixMatrix != nil {
					a.RecvChannelPrefixMatrix[src*C+ch] = int32(run)
				}
				run += recvCounts[ch*R+src]
			}
			if run != block {
				return c.errf(ErrPeer, "rank %d sends %d tokens here but rank_prefix_matrix says %d (handle from another dispatch?)",
					src, run, block)
			}
		}
		a.pad(numRecv, numOut)
		if a.SendHead != nil {
			for i := range a.SendHead {
				a.SendHead[i] = -1
			}
		}
		tasks := make([]task, 0, 2*C)
		for ch := 0; ch < C; ch++ {
			tasks = append(tasks, newDispatchSender(c, a, &lay, ch, counts, rows[ch*R+me]), newDispatchReceiver(c, a, &lay, ch, recvCounts, rows))
		}
		return c.runTasks(tasks, d.workers(C))
	}
	return d.run(op, ds, invalid, zero, body)
}

// zeroRings clears the tail and head words of all rings of a layout in
// this rank's own region (see the package documentation for why this is
// safe right after commit).
func zeroRings(base unsafe.Pointer, lay *ringLayout) {
	for i := 0; i < int(lay.rings); i++ {
		word(base, lay.tailOff(i)).Store(0)
		word(base, lay.headOff(i)).Store(0)
	}
}

// exchangeCounts publishes, in every receiver's tail word of our ring, the
// number of tokens we will push there (count+1 in the upper half, so that 0
// means "not yet known"), and collects what every sender will push to us:
// recv[ch*R+src].
func exchangeCounts(c *call, lay *ringLayout, send []int64) ([]int64, error) {
	d, R, me := c.d, c.R, c.me
	C := len(send) / R
	for dst := 0; dst < R; dst++ {
		for ch := 0; ch < C; ch++ {
			word(d.Buffers[dst], lay.tailOff(ch*R+me)).Store(uint64(send[ch*R+dst]+1) << 32)
		}
	}
	recv := make([]int64, C*R)
	for src := 0; src < R; src++ {
		for ch := 0; ch < C; ch++ {
			w := word(d.Buffers[me], lay.tailOff(ch*R+src))
			err := c.wait(src, func() bool { return w.Load() != 0 }, func() string {
				return fmt.Sprintf("announce its token count for channel %d", ch)
			})
			if err != nil {
				return nil, err
			}
			recv[ch*R+src] = int64(w.Load()>>32) - 1
		}
	}
	return recv, nil
}

// checkSendPrefix compares an optional sender-side channel prefix matrix
// with the counts derived from is_token_in_rank.
func checkSendPrefix(op string, me int, cpm []int32, counts []int64, R, C int) error {
	if cpm == nil {
		return nil
	}
	for dst := 0; dst < R; dst++ {
		var run int64
		for ch := 0; ch < C; ch++ {
			run += counts[ch*R+dst]
			if int64(cpm[dst*C+ch]) != run {
				return newErr(ErrInvalid, "%s: rank %d: channel_prefix_matrix[%d,%d] = %d but is_token_in_rank gives %d",
					op, me, dst, ch, cpm[dst*C+ch], run)
			}
		}
	}
	return nil
}

// pad fills the padding rows [numRecv, numOut) of a worst-case sized output.
func (a *DispatchArgs) pad(numRecv, numOut int) {
	if numOut <= numRecv {
		return
	}
	clear(a.RecvX[numRecv*a.HiddenBytes:])
	if a.ScalesBytes > 0 {
		clear(a.RecvXScales[numRecv*a.ScalesBytes:])
	}
	if a.RecvSrcIdx != nil {
		for i := numRecv; i < numOut; i++ {
			a.RecvSrcIdx[i] = -1
		}
	}
	if a.NumTopk > 0 {
		for i := numRecv * a.NumTopk; i < numOut*a.NumTopk; i++ {
			a.RecvTopkIdx[i] = -1
			a.RecvTopkWeights[i] = 0
		}
	}
}

// validate checks everything that can be checked locally and returns the
// number of received rows and of output rows.
func (a *DispatchArgs) validate(d *Domain) (numRecv, numOut int, err error) {
	const op = "dispatch"
	R, me := d.NumRanks, d.Rank
	bad := func(format string, args ...any) error {
		return newErr(ErrInvalid, "%s: rank %d: "+format, append([]any{op, me}, args...)...)
	}
	if err := a.Config.Validate(); err != nil {
		return 0, 0, bad("%v", err)
	}
	C := a.Config.NumChannels()
	T, K := a.NumTokens, a.NumTopk
	switch {
	case T < 0 || T > maxTokens:
		return 0, 0, bad("num_tokens = %d is out of range", T)
	case a.HiddenBytes <= 0:
		return 0, 0, bad("hidden_bytes = %d must be positive", a.HiddenBytes)
	case a.ScalesBytes < 0:
		return 0, 0, bad("scales_bytes = %d is negative", a.ScalesBytes)
	case a.strided() && (a.ScalesBytes%4 != 0 || a.ScalesTokenStride < 0 || a.ScalesStride < 0):
		return 0, 0, bad("strided scales (strides %d, %d) of %d bytes a token: expected 4-byte words and non-negative strides",
			a.ScalesTokenStride, a.ScalesStride, a.ScalesBytes)
	case K < 0 || K > 1024:
		return 0, 0, bad("num_topk = %d is out of range [0, 1024]", K)
	case K > 0 && (a.NumExperts <= 0 || a.NumExperts%R != 0):
		return 0, 0, bad("num_experts = %d must be a positive multiple of num_ranks = %d", a.NumExperts, R)
	case a.NumWorstTokens < 0 || a.NumWorstTokens > maxTokens:
		return 0, 0, bad("num_worst_tokens = %d is out of range", a.NumWorstTokens)
	case len(a.RankPrefixMatrix) != R*R:
		return 0, 0, bad("rank_prefix_matrix has %d elements, want %d", len(a.RankPrefixMatrix), R*R)
	}
	if err := checkRankPrefix(op, me, a.RankPrefixMatrix, R); err != nil {
		return 0, 0, err
	}
	numRecv = int(a.RankPrefixMatrix[(R-1)*R+me])
	numOut = numRecv
	if a.NumWorstTokens > 0 {
		if numRecv > a.NumWorstTokens {
			return 0, 0, bad("num_worst_tokens = %d is too small: this rank receives %d tokens", a.NumWorstTokens, numRecv)
		}
		numOut = a.NumWorstTokens
	}
	type arg struct {
		name      string
		got, want int
		optional  bool // nil allowed
	}
	args := []arg{
		{"x", len(a.X), T * a.HiddenBytes, false},
		{"x_scales", len(a.XScales), a.scalesSpan(), a.ScalesBytes == 0},
		{"topk_idx", len(a.TopkIdx), T * K, K == 0},
		{"topk_weights", len(a.TopkWeights), T * K, K == 0},
		{"is_token_in_rank", len(a.IsTokenInRank), T * R, false},
		{"channel_prefix_matrix", len(a.ChannelPrefixMatrix), R * C, true},
		{"recv_x", len(a.RecvX), numOut * a.HiddenBytes, false},
		{"recv_x_scales", len(a.RecvXScales), numOut * a.ScalesBytes, a.ScalesBytes == 0},
		{"recv_src_idx", len(a.RecvSrcIdx), numOut, true},
		{"recv_topk_idx", len(a.RecvTopkIdx), numOut * K, K == 0},
		{"recv_topk_weights", len(a.RecvTopkWeights), numOut * K, K == 0},
		{"recv_channel_prefix_matrix", len(a.RecvChannelPrefixMatrix), R * C, true},
		{"send_head", len(a.SendHead), T * R, true},
	}
	for _, x := range args {
		if x.got != x.want && !(x.optional && x.got == 0) {
			return 0, 0, bad("%s has %d elements, want %d", x.name, x.got, x.want)
		}
	}
	if a.ScalesBytes == 0 && (len(a.XScales) != 0 || len(a.RecvXScales) != 0) {
		return 0, 0, bad("x_scales given but scales_bytes = 0")
	}
	if K == 0 && (len(a.TopkIdx) != 0 || len(a.TopkWeights) != 0 || len(a.RecvTopkIdx) != 0 || len(a.RecvTopkWeights) != 0) {
		return 0, 0, bad("topk tensors given but num_topk = 0")
	}
	if K > 0 {
		if err := checkTopk(op+": rank "+fmt.Sprint(me), a.TopkIdx, K, a.NumExperts); err != nil {
			return 0, 0, err
		}
	}
	return numRecv, numOut, nil
}

func (a *DispatchArgs) strided() bool { return a.ScalesTokenStride != 0 || a.ScalesStride != 0 }

// scalesSpan is the bytes of XScales: from the first token's first scale to the last one's last.
func (a *DispatchArgs) scalesSpan() int {
	if !a.strided() {
		return a.NumTokens * a.ScalesBytes
	}
	if a.NumTokens == 0 || a.ScalesBytes == 0 {
		return 0
	}
	return 4 * (1 + (a.NumTokens-1)*a.ScalesTokenStride + (a.ScalesBytes/4-1)*a.ScalesStride)
}

// copyScales copies token t's scales into a ring slot, as one row.
func (a *DispatchArgs) copyScales(dst unsafe.Pointer, t int64) {
	sb := int64(a.ScalesBytes)
	if !a.strided() {
		copy(unsafe.Slice((*byte)(dst), sb), a.XScales[t*sb:(t+1)*sb])
		return
	}
	words := unsafe.Slice((*[4]byte)(dst), sb/4)
	first := t * int64(a.ScalesTokenStride)
	for j := range words {
		at := 4 * (first + int64(j)*int64(a.ScalesStride))
		words[j] = [4]byte(a.XScales[at : at+4])
	}
}

// checkRankPrefix checks that a rank prefix matrix is cumulative (columns
// non-decreasing from 0).
func checkRankPrefix(op string, me int, rpm []int32, R int) error {
	for j := 0; j < R; j++ {
		prev := int32(0)
		for i := 0; i < R; i++ {
			if v := rpm[i*R+j]; v < prev {
				return newErr(ErrInvalid, "%s: rank %d: rank_prefix_matrix[%d,%d] = %d is not cumulative (previous %d)",
					op, me, i, j, v, prev)
			}
			prev = rpm[i*R+j]
		}
	}
	return nil
}

// stream is one ring seen from one side: ring index, the counters and the
// progress of this side.
type stream struct {
	ring        int
	tail, head  *atomic.Uint64
	done, count int64
	hdr         uint64 // sender: (count+1)<<32, the constant upper half of the tail word
}

// dispatchSender pushes the tokens of one channel to all destinations.
type dispatchSender struct {
	c          *call
	a          *DispatchArgs
	lay        *ringLayout
	bufs       []unsafe.Pointer
	ch, R, me  int
	send, recv int64
	epr        int64
	st         []stream
	cur        []int // next token to examine, per destination
	hi         int
	ownRow     int64 // output row of this channel's first token for this rank itself
	note       waitNote
	finished   bool
}

func newDispatchSender(c *call, a *DispatchArgs, lay *ringLayout, ch int, counts []int64, ownRow int64) *dispatchSender {
	R := c.R
	lo, hi := channelRange(a.NumTokens, a.Config.NumChannels(), ch)
	s := &dispatchSender{c: c, a: a, lay: lay, bufs: c.d.Buffers, ch: ch, R: R, me: c.me,
		send: int64(a.Config.NumMaxNVLChunkedSendTokens), recv: int64(a.Config.NumMaxNVLChunkedRecvTokens),
		st: make([]stream, R), cur: make([]int, R), hi: hi, ownRow: ownRow}
	if a.NumTopk > 0 {
		s.epr = int64(a.NumExperts / R)
	}
	ring := ch*R + c.me
	for dst := 0; dst < R; dst++ {
		n := counts[ch*R+dst]
		s.st[dst] = stream{ring: ring, count: n, hdr: uint64(n+1) << 32,
			tail: word(c.d.Buffers[dst], lay.tailOff(ring)), head: word(c.d.Buffers[dst], lay.headOff(ring))}
		s.cur[dst] = lo
	}
	return s
}

func (s *dispatchSender) channel() int      { return s.ch }
func (s *dispatchSender) done() bool        { return s.finished }
func (s *dispatchSender) waiting() waitNote { return s.note }

func (s *dispatchSender) step() (bool, error) {
	a, lay, R := s.a, s.lay, s.R
	hb, sb, K := int64(a.HiddenBytes), int64(a.ScalesBytes), a.NumTopk
	progress, finished := false, true
	for dst := range s.st {
		st := &s.st[dst]
		if dst == s.me {
			if st.done < st.count {
				if err := s.copyOwn(st); err != nil {
					return false, err
				}
				progress = true
			}
			continue
		}
		for st.done < st.count {
			want := min(s.send, st.count-st.done)
			head := int64(st.head.Load())
			if s.recv-(st.done-head) < want {
				s.note = waitNote{peer: dst, kind: waitHead, a: head, b: st.done, cap: s.recv}
				break
			}
			base := s.bufs[dst]
			for j := int64(0); j < want; j++ {
				t, err := s.next(dst)
				if err != nil {
					return false, err
				}
				slot := (st.done + j) % s.recv
				if K > 0 {
					s.localTopk(t, dst, unsafe.Slice((*int64)(unsafe.Add(base, lay.slotOff(dfTopk, st.ring, slot))), K),
						unsafe.Slice((*float32)(unsafe.Add(base, lay.slotOff(dfWeight, st.ring, slot))), K))
				}
				*(*int32)(unsafe.Add(base, lay.slotOff(dfSrc, st.ring, slot))) = int32(t)
				if sb > 0 {
					a.copyScales(unsafe.Add(base, lay.slotOff(dfScales, st.ring, slot)), int64(t))
				}
				copy(unsafe.Slice((*byte)(unsafe.Add(base, lay.slotOff(dfHidden, st.ring, slot))), hb),
					a.X[int64(t)*hb:int64(t+1)*hb])
				if a.SendHead != nil {
					a.SendHead[t*R+dst] = int32(st.done + j)
				}
			}
			st.done += want
			st.tail.Store(st.hdr | uint64(st.done))
			progress = true
		}
		finished = finished && st.done == st.count
	}
	s.finished = finished
	return progress, nil
}

// next is the channel's next token for dst.
func (s *dispatchSender) next(dst int) (int, error) {
	t := s.cur[dst]
	for t < s.hi && !s.a.IsTokenInRank[t*s.R+dst] {
		t++
	}
	if t >= s.hi { // cannot happen: counts come from the same scan
		return 0, s.c.chErrf(s.ch, ErrInvalid, "lost track of the tokens for rank %d (is_token_in_rank changed during the call?)", dst)
	}
	s.cur[dst] = t + 1
	return t, nil
}

// localTopk writes token t's top-k as dst's local experts: the index and weight where dst holds
// the expert, -1 and 0 elsewhere.
func (s *dispatchSender) localTopk(t, dst int, idx []int64, w []float32) {
	a, K, lo := s.a, s.a.NumTopk, int64(dst)*s.epr
	for k := 0; k < K; k++ {
		if e := a.TopkIdx[t*K+k] - lo; e >= 0 && e < s.epr {
			idx[k], w[k] = e, a.TopkWeights[t*K+k]
		} else {
			idx[k], w[k] = -1, 0
		}
	}
}

// copyOwn copies the channel's tokens for this rank itself straight into its output rows, as the
// kernel does: no ring, one copy instead of two, and nothing to wait for.
func (s *dispatchSender) copyOwn(st *stream) error {
	a := s.a
	hb, sb, K := int64(a.HiddenBytes), int64(a.ScalesBytes), int64(a.NumTopk)
	for ; st.done < st.count; st.done++ {
		t, err := s.next(s.me)
		if err != nil {
			return err
		}
		row := s.ownRow + st.done
		copy(a.RecvX[row*hb:(row+1)*hb], a.X[int64(t)*hb:int64(t+1)*hb])
		if sb > 0 {
			a.copyScales(unsafe.Pointer(&a.RecvXScales[row*sb]), int64(t))
		}
		if a.RecvSrcIdx != nil {
			a.RecvSrcIdx[row] = int32(t)
		}
		if K > 0 {
			s.localTopk(t, s.me, a.RecvTopkIdx[row*K:(row+1)*K], a.RecvTopkWeights[row*K:(row+1)*K])
		}
		if a.SendHead != nil {
			a.SendHead[t*s.R+s.me] = int32(st.done)
		}
	}
	return nil
}

// dispatchReceiver copies what every source pushed on one channel into the
// output rows.
type dispatchReceiver struct {
	c        *call
	a        *DispatchArgs
	lay      *ringLayout
	base     unsafe.Pointer // own data region
	ch, me   int
	recv     int64
	st       []stream
	row      []int64 // output row of each source's first token of this channel
	note     waitNote
	finished bool
}

func newDispatchReceiver(c *call, a *DispatchArgs, lay *ringLayout, ch int, recvCounts, rows []int64) *dispatchReceiver {
	R := c.R
	r := &dispatchReceiver{c: c, a: a, lay: lay, base: c.d.Buffers[c.me], ch: ch, me: c.me,
		recv: int64(a.Config.NumMaxNVLChunkedRecvTokens), st: make([]stream, R), row: make([]int64, R)}
	for src := 0; src < R; src++ {
		ring := ch*R + src
		if src == c.me {
			r.st[src] = stream{ring: ring} // this rank's sender writes its own rows
			continue
		}
		r.st[src] = stream{ring: ring, count: recvCounts[ring],
			tail: word(r.base, lay.tailOff(ring)), head: word(r.base, lay.headOff(ring))}
		r.row[src] = rows[ring]
	}
	return r
}

func (r *dispatchReceiver) channel() int      { return r.ch }
func (r *dispatchReceiver) done() bool        { return r.finished }
func (r *dispatchReceiver) waiting() waitNote { return r.note }

func (r *dispatchReceiver) step() (bool, error) {
	a, lay := r.a, r.lay
	hb, sb, K := int64(a.HiddenBytes), int64(a.ScalesBytes), int64(a.NumTopk)
	progress, finished := false, true
	for src := range r.st {
		st := &r.st[src]
		if st.done == st.count {
			continue
		}
		tail := int64(uint32(st.tail.Load()))
		if tail > st.count {
			return false, r.c.chErrf(r.ch, ErrPeer, "rank %d pushed %d tokens, more than the %d it announced", src, tail, st.count)
		}
		if tail == st.done {
			r.note = waitNote{peer: src, kind: waitTail, a: st.done, b: st.count}
			finished = false
			continue
		}
		// Copy [done, tail) in runs that do not wrap around the ring: slots
		// of a run are contiguous in every field array, and so are the rows.
		for st.done < tail {
			slot := st.done % r.recv
			n := min(tail-st.done, r.recv-slot)
			row := r.row[src] + st.done
			copy(a.RecvX[row*hb:(row+n)*hb], unsafe.Slice((*byte)(unsafe.Add(r.base, lay.slotOff(dfHidden, st.ring, slot))), n*hb))
			if sb > 0 {
				copy(a.RecvXScales[row*sb:(row+n)*sb], unsafe.Slice((*byte)(unsafe.Add(r.base, lay.slotOff(dfScales, st.ring, slot))), n*sb))
			}
			if a.RecvSrcIdx != nil {
				copy(a.RecvSrcIdx[row:row+n], unsafe.Slice((*int32)(unsafe.Add(r.base, lay.slotOff(dfSrc, st.ring, slot))), n))
			}
			if K > 0 {
				copy(a.RecvTopkIdx[row*K:(row+n)*K], unsafe.Slice((*int64)(unsafe.Add(r.base, lay.slotOff(dfTopk, st.ring, slot))), n*K))
				copy(a.RecvTopkWeights[row*K:(row+n)*K], unsafe.Slice((*float32)(unsafe.Add(r.base, lay.slotOff(dfWeight, st.ring, slot))), n*K))
			}
			st.done += n
		}
		st.head.Store(uint64(st.done))
		progress = true
		finished = finished && st.done == st.count
	}
	r.finished = finished
	return progress, nil
}
