package normal

import (
	"fmt"
	"unsafe"
)

// CombineArgs are the arguments of Combine, the reverse of a dispatch.
// Slices alias caller (Python) memory.
type CombineArgs struct {
	Config    Config
	DType     DType // element type of X, Bias0/1 and CombinedX
	Hidden    int   // elements per row
	NumTopk   int   // K of TopkWeights, 0 without weights
	NumTokens int   // T: tokens this rank dispatched (rows of SendHead and the outputs)

	// This rank's received rows in dispatch order: at least
	// RankPrefixMatrix[R-1][Rank] rows (more when the dispatch used
	// num_worst_tokens; padding rows are ignored).
	X           []byte    // [rows, Hidden]
	TopkWeights []float32 // [rows, K] or nil
	SrcIdx      []int32   // [rows]: recv_src_idx of the dispatch

	// From the dispatch handle.
	RankPrefixMatrix    []int32 // [R, R]
	ChannelPrefixMatrix []int32 // [R, C]: the dispatch's recv_channel_prefix_matrix
	SendHead            []int32 // [T, R]: the dispatch's send_head

	Bias0, Bias1 []byte // [T, Hidden] or nil, added to every token's result

	CombinedX           []byte    // out [T, Hidden]
	CombinedTopkWeights []float32 // out [T, K] when K > 0
}

// Combine sends every received row back to its source rank and token and
// reduces there: CombinedX[t] = bias0[t] + bias1[t] + the rows returned by
// the ranks that received t, in increasing rank order, summed in float32 and
// rounded once to DType. CombinedTopkWeights[t][k] is the float32 sum, in
// the same order, of the returned weights (each rank returns 0 where it did
// not hold the expert, so the sum reconstructs the original weights). A
// token sent nowhere gets its bias (or zeros).
func Combine(d *Domain, a *CombineArgs) error {
	const op = "combine"
	if err := d.check(op); err != nil {
		return err
	}
	R, me := d.NumRanks, d.Rank
	C := a.Config.NumChannels()
	var sendCnt, sendRow, expect []int64
	var lay ringLayout
	invalid := a.validate(d)
	if invalid == nil {
		sendCnt, sendRow, invalid = a.sendPlan(d)
	}
	if invalid == nil {
		expect, invalid = checkSendHead(op, me, a.SendHead, a.NumTokens, R, C)
	}
	rowBytes := a.Hidden * a.DType.Size()
	if invalid == nil {
		lay = combineLayout(a.Config, R, rowBytes, a.NumTopk)
		invalid = checkBuffer(op, d, lay.total, fmt.Sprintf(
			"%d ranks x %d channels x %d slots of %d bytes (%d x %v, top-k %d) with config %v",
			R, C, a.Config.NumMaxNVLChunkedRecvTokens, 4+4*a.NumTopk+rowBytes, a.Hidden, a.DType, a.NumTopk, a.Config))
	}
	ds := desc{op: opCombine,
		names: []string{"num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
			"dtype", "hidden", "num_topk"},
		vals: []uint64{uint64(a.Config.NumSMs), uint64(a.Config.NumMaxNVLChunkedSendTokens), uint64(a.Config.NumMaxNVLChunkedRecvTokens),
			uint64(a.DType), uint64(a.Hidden), uint64(a.NumTopk)}}
	zero := func() { zeroRings(d.Buffers[me], &lay) }
	body := func(c *call) error {
		recvCnt, err := exchangeCounts(c, &lay, sendCnt)
		if err != nil {
			return err
		}
		for ch := 0; ch < C; ch++ {
			for r := 0; r < R; r++ {
				if got, want := recvCnt[ch*R+r], expect[ch*R+r]; got != want {
					return c.chErrf(ch, ErrPeer, "rank %d returns %d tokens but send_head expects %d (handle from another dispatch?)",
						r, got, want)
				}
			}
		}
		nw := d.workers(C)
		accs := make([]float32, nw*(a.Hidden+a.NumTopk))
		tasks := make([]task, 0, 2*C)
		for ch := 0; ch < C; ch++ {
			// Channels of one worker share its accumulator (tasks of one
			// worker never run concurrently).
			w := ch % nw
			acc := accs[w*(a.Hidden+a.NumTopk) : (w+1)*(a.Hidden+a.NumTopk)]
			tasks = append(tasks, newCombineSender(c, a, &lay, ch, sendCnt, sendRow),
				newCombineReceiver(c, a, &lay, ch, recvCnt, acc[:a.Hidden], acc[a.Hidden:]))
		}
		return c.runTasks(tasks, nw)
	}
	return d.run(op, ds, invalid, zero, body)
}

func (a *CombineArgs) validate(d *Domain) error {
	const op = "combine"
	R, me := d.NumRanks, d.Rank
	bad := func(format string, args ...any) error {
		return newErr(ErrInvalid, "%s: rank %d: "+format, append([]any{op, me}, args...)...)
	}
	if err := a.Config.Validate(); err != nil {
		return bad("%v", err)
	}
	C := a.Config.NumChannels()
	T, K, es := a.NumTokens, a.NumTopk, a.DType.Size()
	switch {
	case es == 0:
		return bad("unsupported dtype %v (want bfloat16, float16 or float32)", a.DType)
	case a.Hidden <= 0:
		return bad("hidden = %d must be positive", a.Hidden)
	case K < 0 || K > 1024:
		return bad("num_topk = %d is out of range [0, 1024]", K)
	case T < 0 || T > maxTokens:
		return bad("num_tokens = %d is out of range", T)
	case len(a.RankPrefixMatrix) != R*R:
		return bad("rank_prefix_matrix has %d elements, want %d", len(a.RankPrefixMatrix), R*R)
	}
	if err := checkRankPrefix(op, me, a.RankPrefixMatrix, R); err != nil {
		return err
	}
	rowBytes := a.Hidden * es
	numRecv := int(a.RankPrefixMatrix[(R-1)*R+me])
	if len(a.X)%rowBytes != 0 || len(a.X)/rowBytes < numRecv {
		return bad("x has %d bytes, want %d rows of %d bytes (at least the %d received rows)",
			len(a.X), len(a.X)/rowBytes, rowBytes, numRecv)
	}
	rows := len(a.X) / rowBytes
	type arg struct {
		name      string
		got, want int
		optional  bool
	}
	for _, x := range []arg{
		{"topk_weights", len(a.TopkWeights), rows * K, K == 0},
		{"src_idx", len(a.SrcIdx), rows, false},
		{"channel_prefix_matrix", len(a.ChannelPrefixMatrix), R * C, false},
		{"send_head", len(a.SendHead), T * R, false},
		{"bias_0", len(a.Bias0), T * rowBytes, true},
		{"bias_1", len(a.Bias1), T * rowBytes, true},
		{"combined_x", len(a.CombinedX), T * rowBytes, false},
		{"combined_topk_weights", len(a.CombinedTopkWeights), T * K, K == 0},
	} {
		if x.got != x.want && !(x.optional && x.got == 0) {
			return bad("%s has %d elements, want %d", x.name, x.got, x.want)
		}
	}
	if K == 0 && (len(a.TopkWeights) != 0 || len(a.CombinedTopkWeights) != 0) {
		return bad("topk_weights given but num_topk = 0")
	}
	// Bias and output are read and written as typed elements.
	for _, b := range []struct {
		name string
		s    []byte
	}{{"bias_0", a.Bias0}, {"bias_1", a.Bias1}, {"combined_x", a.CombinedX}} {
		if len(b.s) > 0 && uintptr(unsafe.Pointer(unsafe.SliceData(b.s)))%uintptr(es) != 0 {
			return bad("%s is not aligned to its %d-byte elements", b.name, es)
		}
	}
	return nil
}

// sendPlan derives from the handle which of our rows go back on which
// (channel, source) stream: count[ch*R+src] rows starting at row[ch*R+src].
func (a *CombineArgs) sendPlan(d *Domain) (count, row []int64, err error) {
	R, me := d.NumRanks, d.Rank
	C := a.Config.NumChannels()
	count, row = make([]int64, C*R), make([]int64, C*R)
	for src := 0; src < R; src++ {
		var base int64
		if src > 0 {
			base = int64(a.RankPrefixMatrix[(src-1)*R+me])
		}
		block := int64(a.RankPrefixMatrix[src*R+me]) - base
		prev := int64(0)
		for ch := 0; ch < C; ch++ {
			v := int64(a.ChannelPrefixMatrix[src*C+ch])
			if v < prev || v > block || (ch == 0 && v != 0) {
				return nil, nil, newErr(ErrInvalid, "combine: rank %d: channel_prefix_matrix[%d,%d] = %d is not an exclusive prefix within the %d rows from rank %d",
					me, src, ch, v, block, src)
			}
			end := block
			if ch+1 < C {
				end = min(max(int64(a.ChannelPrefixMatrix[src*C+ch+1]), v), block)
			}
			row[ch*R+src], count[ch*R+src] = base+v, end-v
			prev = v
		}
	}
	return count, row, nil
}

// checkSendHead checks that send_head numbers the tokens of every
// (channel, dst) stream 0, 1, 2, ... in token order (-1: not sent) and
// returns the stream lengths expect[ch*R+dst].
func checkSendHead(op string, me int, sh []int32, T, R, C int) ([]int64, error) {
	expect := make([]int64, C*R)
	for ch := 0; ch < C; ch++ {
		lo, hi := channelRange(T, C, ch)
		next := expect[ch*R : (ch+1)*R]
		for t := lo; t < hi; t++ {
			for dst, v := range sh[t*R : (t+1)*R] {
				if v == -1 {
					continue
				}
				if int64(v) != next[dst] {
					return nil, newErr(ErrInvalid, "%s: rank %d: send_head[%d,%d] = %d, want %d or -1 (the %d-th token of channel %d for rank %d)",
						op, me, t, dst, v, next[dst], next[dst], ch, dst)
				}
				next[dst]++
			}
		}
	}
	return expect, nil
}

// combineSender returns the rows of one channel to every source rank.
type combineSender struct {
	c          *call
	a          *CombineArgs
	lay        *ringLayout
	bufs       []unsafe.Pointer
	ch         int
	send, recv int64
	st         []stream
	row        []int64
	note       waitNote
	finished   bool
}

func newCombineSender(c *call, a *CombineArgs, lay *ringLayout, ch int, count, row []int64) *combineSender {
	R := c.R
	s := &combineSender{c: c, a: a, lay: lay, bufs: c.d.Buffers, ch: ch,
		send: int64(a.Config.NumMaxNVLChunkedSendTokens), recv: int64(a.Config.NumMaxNVLChunkedRecvTokens),
		st: make([]stream, R), row: make([]int64, R)}
	ring := ch*R + c.me
	for src := 0; src < R; src++ {
		n := count[ch*R+src]
		s.st[src] = stream{ring: ring, count: n, hdr: uint64(n+1) << 32,
			tail: word(c.d.Buffers[src], lay.tailOff(ring)), head: word(c.d.Buffers[src], lay.headOff(ring))}
		s.row[src] = row[ch*R+src]
	}
	return s
}

func (s *combineSender) channel() int      { return s.ch }
func (s *combineSender) done() bool        { return s.finished }
func (s *combineSender) waiting() waitNote { return s.note }

func (s *combineSender) step() (bool, error) {
	a, lay := s.a, s.lay
	rb, K := int64(a.Hidden*a.DType.Size()), int64(a.NumTopk)
	progress, finished := false, true
	for src := range s.st {
		st := &s.st[src]
		for st.done < st.count {
			want := min(s.send, st.count-st.done)
			head := int64(st.head.Load())
			if s.recv-(st.done-head) < want {
				s.note = waitNote{peer: src, kind: waitHead, a: head, b: st.done, cap: s.recv}
				break
			}
			base := s.bufs[src]
			// Rows are contiguous in x and, up to the ring's wrap, in the
			// slot arrays: copy in runs.
			for end := st.done + want; st.done < end; {
				slot := st.done % s.recv
				n := min(end-st.done, s.recv-slot)
				row := s.row[src] + st.done
				copy(unsafe.Slice((*byte)(unsafe.Add(base, lay.slotOff(cfRow, st.ring, slot))), n*rb), a.X[row*rb:(row+n)*rb])
				copy(unsafe.Slice((*int32)(unsafe.Add(base, lay.slotOff(cfSrc, st.ring, slot))), n), a.SrcIdx[row:row+n])
				if K > 0 {
					copy(unsafe.Slice((*float32)(unsafe.Add(base, lay.slotOff(cfWeight, st.ring, slot))), n*K), a.TopkWeights[row*K:(row+n)*K])
				}
				st.done += n
			}
			st.tail.Store(st.hdr | uint64(st.done))
			progress = true
		}
		finished = finished && st.done == st.count
	}
	s.finished = finished
	return progress, nil
}

// combineReceiver reduces the tokens of one channel in token order.
type combineReceiver struct {
	c        *call
	a        *CombineArgs
	lay      *ringLayout
	base     unsafe.Pointer
	ch, R    int
	t, hi    int
	recv     int64
	batch    int
	st       []stream // per returning rank; done = slots consumed
	tails    []int64  // last tail seen per returning rank
	dirty    []bool
	acc, w   []float32
	note     waitNote
	finished bool
}

func newCombineReceiver(c *call, a *CombineArgs, lay *ringLayout, ch int, recvCnt []int64, acc, w []float32) *combineReceiver {
	R := c.R
	lo, hi := channelRange(a.NumTokens, a.Config.NumChannels(), ch)
	r := &combineReceiver{c: c, a: a, lay: lay, base: c.d.Buffers[c.me], ch: ch, R: R, t: lo, hi: hi,
		recv: int64(a.Config.NumMaxNVLChunkedRecvTokens), batch: max(1, a.Config.NumMaxNVLChunkedSendTokens),
		st: make([]stream, R), tails: make([]int64, R), dirty: make([]bool, R), acc: acc, w: w}
	for src := 0; src < R; src++ {
		ring := ch*R + src
		r.st[src] = stream{ring: ring, count: recvCnt[ring],
			tail: word(r.base, lay.tailOff(ring)), head: word(r.base, lay.headOff(ring))}
	}
	r.finished = lo == hi
	return r
}

func (r *combineReceiver) channel() int      { return r.ch }
func (r *combineReceiver) done() bool        { return r.finished }
func (r *combineReceiver) waiting() waitNote { return r.note }

func (r *combineReceiver) step() (bool, error) {
	a, lay, R := r.a, r.lay, r.R
	es := a.DType.Size()
	rb, K := a.Hidden*es, a.NumTopk
	progress := false
	var err error
tokens:
	for n := 0; r.t < r.hi && n < r.batch; n++ {
		t := r.t
		sh := a.SendHead[t*R : (t+1)*R]
		for src, idx := range sh {
			if idx < 0 || int64(idx) < r.tails[src] {
				continue
			}
			st := &r.st[src]
			tail := int64(uint32(st.tail.Load()))
			if tail > st.count {
				err = r.c.chErrf(r.ch, ErrPeer, "rank %d pushed %d rows, more than the %d it announced", src, tail, st.count)
				break tokens
			}
			r.tails[src] = tail
			if int64(idx) >= tail {
				r.note = waitNote{peer: src, kind: waitToken, a: int64(t), b: int64(idx), cap: tail}
				break tokens
			}
		}
		acc, w := r.acc, r.w
		clear(acc)
		clear(w)
		if a.Bias0 != nil {
			addRow(acc, unsafe.Pointer(&a.Bias0[t*rb]), a.DType)
		}
		if a.Bias1 != nil {
			addRow(acc, unsafe.Pointer(&a.Bias1[t*rb]), a.DType)
		}
		for src, idx := range sh {
			if idx < 0 {
				continue
			}
			st := &r.st[src]
			slot := int64(idx) % r.recv
			if got := *(*int32)(unsafe.Add(r.base, lay.slotOff(cfSrc, st.ring, slot))); got != int32(t) {
				err = r.c.chErrf(r.ch, ErrPeer, "rank %d returned the row of token %d where send_head expects token %d (handle from another dispatch?)",
					src, got, t)
				break tokens
			}
			addRow(acc, unsafe.Add(r.base, lay.slotOff(cfRow, st.ring, slot)), a.DType)
			if K > 0 {
				for k, v := range unsafe.Slice((*float32)(unsafe.Add(r.base, lay.slotOff(cfWeight, st.ring, slot))), K) {
					w[k] += v
				}
			}
			st.done = int64(idx) + 1
			r.dirty[src] = true
		}
		if rb > 0 {
			storeRow(unsafe.Pointer(&a.CombinedX[t*rb]), acc, a.DType)
		}
		if K > 0 {
			copy(a.CombinedTopkWeights[t*K:(t+1)*K], w)
		}
		r.t++
		progress = true
	}
	for src, dirty := range r.dirty {
		if dirty {
			r.st[src].head.Store(uint64(r.st[src].done))
			r.dirty[src] = false
		}
	}
	r.finished = r.t == r.hi
	return progress, err
}
