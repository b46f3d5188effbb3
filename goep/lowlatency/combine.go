package lowlatency

import (
	"fmt"
	"unsafe"
)

// CombineArgs are a low-latency combine's: the expert outputs X [L][RM][H] bf16 in the layout of
// the dispatch's recv_x (nil with ZeroCopy: the rows are already in the send area that
// NextCombineBuffer named), the dispatch's handle (SrcInfo [L][RM], LayoutRange [L][R]), this
// rank's T dispatched tokens' TopkIdx and TopkWeights [T, K], and Out [T, H] bf16, the weighted
// sums. WaitStats [R] += ns waited for each rank (nil: none).
type CombineArgs struct {
	Shape
	NumTokens, NumTopk int
	X                  []uint16
	ZeroCopy           bool
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

// Combine runs a combine's send phase: every received row goes back to its token's rank, into
// the slot (this rank's global expert, token index) of that rank's recv area, and then the flag
// of each of this rank's experts at every unmasked rank. The returned Recv sums the rows.
func (e *Engine) Combine(a *CombineArgs) (*Recv, error) {
	if err := a.check(e.d.NumRanks); err != nil {
		return nil, err
	}
	l, h, seq, err := e.begin("low_latency_combine", a.Shape)
	if err != nil {
		return nil, err
	}
	if err := e.combineSend(a, l, h, seq); err != nil {
		return nil, err
	}
	return e.pend(h, seq, func() error { return e.combineRecv(a, l, h, seq) }), nil
}

func (e *Engine) combineSend(a *CombineArgs, l Layout, h int, seq uint32) error {
	me, R, H, L := e.d.Rank, e.d.NumRanks, a.Hidden, l.NumLocalExperts
	RM := R * a.MaxTokens
	rows := a.X
	if a.ZeroCopy {
		rows = unsafe.Slice((*uint16)(at(e.d.Regions[me], l.Send(h))), L*RM*H)
	}
	for dst := range R {
		ok, err := e.awaitAck("low_latency_combine", l, h, seq, dst)
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		for j := range L {
			v := a.LayoutRange[j*R+dst]
			begin, n := int(v>>32), int(int32(v))
			for i := range n {
				row := j*RM + begin + i
				t := int(a.SrcInfo[row])
				e.write(dst, l.CombineSlot(h, me*L+j, t), unsafe.Slice((*byte)(unsafe.Pointer(&rows[row*H])), 2*H))
			}
			e.signal(dst, l.CombineFlags(h)+8*int64(me*L+j), flag(seq, 1))
		}
	}
	return e.unsignalled("low_latency_combine")
}

func (e *Engine) combineRecv(a *CombineArgs, l Layout, h int, seq uint32) error {
	R, H, K, L := e.d.NumRanks, a.Hidden, a.NumTopk, l.NumLocalExperts
	base := e.d.Regions[e.d.Rank]
	for src := range R {
		var spent int64
		for j := 0; j < L && !e.Masked(src); j++ {
			fw := e.word(e.d.Rank, l.CombineFlags(h)+8*int64(src*L+j))
			_, d, err := e.wait(src, func() string {
				return fmt.Sprintf("low_latency_combine: waiting for the rows of its expert %d (call %d)", src*L+j, seq)
			}, func() bool { return uint32(fw.Load()>>32) == seq })
			if err != nil {
				return err
			}
			spent += d.Nanoseconds()
		}
		if a.WaitStats != nil {
			a.WaitStats[src] += spent
		}
	}
	acc := make([]float32, H)
	for t := range a.NumTokens {
		clear(acc)
		for k := range K {
			g := a.TopkIdx[t*K+k]
			if g < 0 || e.Masked(int(g)/L) {
				continue
			}
			w := a.TopkWeights[t*K+k]
			row := unsafe.Slice((*uint16)(at(base, l.CombineSlot(h, int(g), t))), H)
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
