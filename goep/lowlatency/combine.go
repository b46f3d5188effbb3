package lowlatency

import (
	"fmt"
	"math"
	"unsafe"
)

// CombineArgs are a low-latency combine's: the expert outputs X [L][RM][H] bf16 in the layout of
// the dispatch's recv_x (nil with ZeroCopy: the rows are already in the send area that
// NextCombineBuffer named), the dispatch's handle (SrcInfo [L][RM], LayoutRange [L][R]), this
// rank's T dispatched tokens' TopkIdx and TopkWeights [T, K], and Out [T, H] bf16, the weighted
// sums. WaitStats [R] += ns waited for each rank (nil: none). With LogFMT the rows cross in
// LogFMT-10 (logfmt.go): each (token, rank) row as it would be in bf16, encoded by its sender and
// decoded by the token's rank before it is summed.
type CombineArgs struct {
	Shape
	NumTokens, NumTopk int
	X                  []uint16
	ZeroCopy, LogFMT   bool
	SrcInfo            []int32
	LayoutRange        []int64
	TopkIdx            []int64
	TopkWeights        []float32
	Out                []uint16
	WaitStats          []int64
}

func (a *CombineArgs) check(R int) error {
	T, K, H, M, E := a.NumTokens, a.NumTopk, a.Hidden, a.MaxTokens, a.NumExperts
	L, RM := E/R, R*M
	switch {
	case T < 0 || T > M:
		return invalid("topk_weights: %d tokens, expected at most num_max_dispatch_tokens_per_rank = %d", T, M)
	case K < 1 || K > MaxTopk:
		return invalid("topk_idx: %d experts a token, expected 1 to %d", K, MaxTopk)
	case !a.ZeroCopy && len(a.X) < L*RM*H:
		return invalid("x: %d elements, expected [%d, %d, %d]", len(a.X), L, RM, H)
	case len(a.SrcInfo) < L*RM || len(a.LayoutRange) < L*R:
		return invalid("handle: src_info or layout_range smaller than [%d, %d] and [%d, %d]", L, RM, L, R)
	case len(a.TopkIdx) < T*K || len(a.TopkWeights) < T*K || len(a.Out) < T*H:
		return invalid("topk_idx, topk_weights or out smaller than [%d, %d], [%d, %d], [%d, %d]", T, K, T, K, T, H)
	case a.WaitStats != nil && len(a.WaitStats) < R:
		return invalid("combine_wait_recv_cost_stats: %d entries, expected num_ranks = %d", len(a.WaitStats), R)
	}
	for i, g := range a.TopkIdx[:T*K] {
		if g < -1 || g >= int64(E) {
			return invalid("topk_idx[%d, %d] = %d: expected -1 or an expert in [0, %d)", i/K, i%K, g, E)
		}
	}
	for j := range L {
		for r := range R {
			v := a.LayoutRange[j*R+r]
			begin, n := int(v>>32), int(int32(v))
			if begin < 0 || n < 0 || n > M || begin+n > RM {
				return invalid("handle: layout_range[%d, %d] = (begin %d, count %d): expected at most %d rows within [0, %d)",
					j, r, begin, n, M, RM)
			}
			for _, t := range a.SrcInfo[j*RM+begin : j*RM+begin+n] {
				if t < 0 || int(t) >= M {
					return invalid("handle: src_info of local expert %d holds token %d, outside [0, %d)", j, t, M)
				}
			}
		}
	}
	return nil
}

// Combine runs a combine's send phase, combine by rank: at most one row per (token, rank)
// crosses the link. This rank first pushes its tokens' selections (expert and weight, MaxTopk a
// token) into the push area of every peer it may write, then, for every rank src (itself
// included), it sends each of src's tokens that selected its experts one row: the received row
// itself if the token selected one of them, else its partial sum in float32 of weight times row
// over those selections in k order, rounded to bf16 once. The rows go to the token's slot [this
// rank][token] of src's recv area, then one flag at [this rank]. A peer whose selections have not
// arrived yet is not waited for: the returned Recv sends its rows first (so a hooked send returns
// whatever its peers do), then weighs and sums the rows (combineRecv).
func (e *Engine) Combine(a *CombineArgs) (*Recv, error) {
	if err := a.check(e.d.NumRanks); err != nil {
		return nil, err
	}
	l, h, seq, err := e.begin("low_latency_combine", a.Shape)
	if err != nil {
		return nil, err
	}
	s, err := e.combineSend(a, l, h, seq)
	if err != nil {
		return nil, err
	}
	return e.pend(h, seq, func() error {
		for _, src := range s.later {
			if err := s.send(src); err != nil {
				return err
			}
		}
		if err := e.unsignalled("low_latency_combine"); err != nil {
			return err
		}
		return e.combineRecv(a, l, h, seq)
	}), nil
}

// pushEntry is a selection as the push area holds it: the int32 expert in the low word, the
// float32 weight's bits in the high word.
func pushEntry(g int64, w float32) uint64 {
	return uint64(uint32(int32(g))) | uint64(math.Float32bits(w))<<32
}

// combineSender is a combine's send phase; later are the peers whose rows wait for their
// selections (sent by the receive).
type combineSender struct {
	e       *Engine
	a       *CombineArgs
	l       Layout
	h       int
	seq     uint32
	rows    []uint16
	mine    []uint64 // this rank's selections, as pushed
	later   []int
	zeros   []uint16
	scratch []uint16
	acc     []float32
	packed  []byte // a LogFMT row
}

func (e *Engine) combineSend(a *CombineArgs, l Layout, h int, seq uint32) (*combineSender, error) {
	me, R, H, L := e.d.Rank, e.d.NumRanks, a.Hidden, l.NumLocalExperts
	T, K, RM := a.NumTokens, a.NumTopk, R*a.MaxTokens
	s := &combineSender{e: e, a: a, l: l, h: h, seq: seq, rows: a.X,
		zeros: make([]uint16, H), scratch: make([]uint16, H), acc: make([]float32, H)}
	if a.LogFMT {
		s.packed = make([]byte, LogFMTBytes(H))
	}
	if a.ZeroCopy {
		s.rows = unsafe.Slice((*uint16)(at(e.d.Regions[me], l.Send(h))), L*RM*H)
	}
	// This rank's selections, pushed to every peer it may write (and read from here for itself).
	// The slice is fresh, so that a remote put reads it unchanged.
	s.mine = make([]uint64, T*MaxTopk)
	for t := range T {
		for k := range MaxTopk {
			s.mine[t*MaxTopk+k] = pushEntry(-1, 0)
			if k < K {
				s.mine[t*MaxTopk+k] = pushEntry(a.TopkIdx[t*K+k], a.TopkWeights[t*K+k])
			}
		}
	}
	writable := make([]bool, R)
	for dst := range R {
		ok, err := e.awaitAck("low_latency_combine", l, h, seq, dst)
		if err != nil {
			return nil, err
		}
		writable[dst] = ok
		if !ok || dst == me {
			continue
		}
		if T > 0 {
			e.write(dst, l.PushEntry(h, me, 0, 0), unsafe.Slice((*byte)(unsafe.Pointer(&s.mine[0])), 8*len(s.mine)))
		}
		e.signal(dst, l.PushFlag(h, me), flag(seq, uint32(T)))
	}
	// Then every rank's tokens that selected this rank's experts get their row back.
	for src := range R {
		if !writable[src] {
			continue
		}
		if src != me && uint32(e.word(me, l.PushFlag(h, src)).Load()>>32) != seq && !e.Masked(src) {
			s.later = append(s.later, src)
			continue
		}
		if err := s.send(src); err != nil {
			return nil, err
		}
	}
	return s, e.unsignalled("low_latency_combine")
}

// send sends rank src its tokens' rows from this rank, then its flag; a peer's once its
// selections arrived (waiting for them), none if it is masked.
func (s *combineSender) send(src int) error {
	e, a, l, h, seq := s.e, s.a, s.l, s.h, s.seq
	me, R, H, L, M := e.d.Rank, e.d.NumRanks, a.Hidden, l.NumLocalExperts, a.MaxTokens
	RM, rows, zeros, scratch, acc := R*M, s.rows, s.zeros, s.scratch, s.acc
	sel, Tsrc := s.mine, a.NumTokens
	if src != me {
		fw := e.word(me, l.PushFlag(h, src))
		ok, _, err := e.wait(src, func() string {
			return fmt.Sprintf("low_latency_combine: waiting for rank %d's top-k (call %d)", src, seq)
		}, func() bool { return uint32(fw.Load()>>32) == seq })
		if err != nil {
			return err
		}
		if !ok {
			return nil
		}
		Tsrc = int(uint32(fw.Load()))
		if Tsrc > M {
			return fmt.Errorf("low_latency_combine: pyep internal error: rank %d pushed %d tokens, more than %d", src, Tsrc, M)
		}
		sel = unsafe.Slice((*uint64)(at(e.d.Regions[me], l.PushEntry(h, src, 0, 0))), Tsrc*MaxTopk)
	}
	// rowOf[j*Tsrc + t]: the row of src's token t at local expert j (-1: none).
	rowOf := make([]int32, L*Tsrc)
	for i := range rowOf {
		rowOf[i] = -1
	}
	for j := range L {
		v := a.LayoutRange[j*R+src]
		begin, n := int(v>>32), int(int32(v))
		for i := range n {
			row := j*RM + begin + i
			if t := int(a.SrcInfo[row]); t < Tsrc {
				rowOf[j*Tsrc+t] = int32(row)
			}
		}
	}
	for t := range Tsrc {
		var ks [MaxTopk]int
		n := 0
		for k, v := range sel[t*MaxTopk : (t+1)*MaxTopk] {
			if g := int(int32(uint32(v))); g >= 0 && g < a.NumExperts && g/L == me {
				ks[n] = k
				n++
			}
		}
		var out []uint16
		switch n {
		case 0:
			continue
		case 1:
			v := sel[t*MaxTopk+ks[0]]
			out = zeros
			if row := rowOf[(int(int32(uint32(v)))-me*L)*Tsrc+t]; row >= 0 {
				out = rows[int(row)*H : (int(row)+1)*H]
			}
		default:
			clear(acc)
			for _, k := range ks[:n] {
				v := sel[t*MaxTopk+k]
				row := rowOf[(int(int32(uint32(v)))-me*L)*Tsrc+t]
				if row < 0 {
					continue
				}
				w := math.Float32frombits(uint32(v >> 32))
				for c, x := range rows[int(row)*H : (int(row)+1)*H] {
					acc[c] += float32(bf16ToF32(x) * w)
				}
			}
			out = scratch
			if e.remote(src) {
				out = make([]uint16, H)
			}
			for c, v := range acc {
				out[c] = f32ToBF16(v)
			}
		}
		msg := unsafe.Slice((*byte)(unsafe.Pointer(&out[0])), 2*H)
		if a.LogFMT {
			msg = s.packed
			if e.remote(src) {
				msg = make([]byte, len(s.packed))
			}
			EncodeLogFMT(msg, out)
		}
		e.write(src, l.CombineSlot(h, me, t), msg)
	}
	e.signal(src, l.CombineFlags(h)+8*int64(me), flag(seq, 1))
	return nil
}

// combineRecv waits for every unmasked rank's rows and sums, for each token, the terms of the
// ranks it selected, in the order of each rank's first selection: w * row in float32 for a
// rank's only selection, the rank's pre-reduced bf16 row otherwise; the sum is rounded once.
func (e *Engine) combineRecv(a *CombineArgs, l Layout, h int, seq uint32) error {
	R, H, K, L := e.d.NumRanks, a.Hidden, a.NumTopk, l.NumLocalExperts
	base := e.d.Regions[e.d.Rank]
	for src := range R {
		if e.Masked(src) {
			continue
		}
		fw := e.word(e.d.Rank, l.CombineFlags(h)+8*int64(src))
		_, d, err := e.wait(src, func() string {
			return fmt.Sprintf("low_latency_combine: waiting for rank %d's rows (call %d)", src, seq)
		}, func() bool { return uint32(fw.Load()>>32) == seq })
		if err != nil {
			return err
		}
		if a.WaitStats != nil {
			a.WaitStats[src] += d.Nanoseconds()
		}
	}
	acc, decoded := make([]float32, H), make([]uint16, H)
	for t := range a.NumTokens {
		clear(acc)
		sel := a.TopkIdx[t*K : (t+1)*K]
	next:
		for k, g := range sel {
			if g < 0 {
				continue
			}
			r, n := int(g)/L, 0
			for k2, g2 := range sel {
				if g2 >= 0 && int(g2)/L == r {
					if k2 < k {
						continue next // not r's first selection: its term is in
					}
					n++
				}
			}
			if e.Masked(r) {
				continue
			}
			row := unsafe.Slice((*uint16)(at(base, l.CombineSlot(h, r, t))), H)
			if a.LogFMT {
				DecodeLogFMT(decoded, unsafe.Slice((*byte)(at(base, l.CombineSlot(h, r, t))), LogFMTBytes(H)))
				row = decoded
			}
			if n > 1 {
				for c, v := range row {
					acc[c] += bf16ToF32(v)
				}
				continue
			}
			w := a.TopkWeights[t*K+k]
			for c, v := range row {
				acc[c] += float32(bf16ToF32(v) * w)
			}
		}
		out := a.Out[t*H : (t+1)*H]
		for c, v := range acc {
			out[c] = f32ToBF16(v)
		}
	}
	e.acknowledge(l, h, seq)
	return nil
}
