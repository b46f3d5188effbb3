package lowlatency

import (
	"fmt"
	"slices"
	"unsafe"
)

// DispatchArgs are a low-latency dispatch's: T tokens X [T, H] (bf16 bits) selecting experts
// TopkIdx [T, K] (-1: none), and the outputs, indexed as DeepEP lays them out (L local experts,
// RM = num_ranks * num_max_dispatch_tokens_per_rank rows each):
//
//	RecvX       [L][RM][H]   e4m3 bytes with UseFP8, bf16 otherwise
//	RecvScales  [L][S][RM]   column-major scales, as uint32: float32 bits (S = H/128), or with
//	                         UseUE8M0 four exponent bytes a word, scale 4i+b in byte b of word i
//	                         (S = ceil(H/512)); nil without UseFP8
//	SrcInfo     [L][RM]      the source token index of each row
//	LayoutRange [L][R]       (begin << 32) | count of source rank r's rows for expert j
//	Count       [L]          rows received for each local expert
//	CumStats    [L]          += Count (nil: none); WaitStats [R] += ns waited for each rank (nil: none)
type DispatchArgs struct {
	Shape
	NumTokens, NumTopk           int
	X                            []uint16
	TopkIdx                      []int64
	UseFP8, RoundScale, UseUE8M0 bool
	RecvX                        []byte
	RecvScales                   []uint32
	SrcInfo                      []int32
	LayoutRange                  []int64
	Count, CumStats              []int32
	WaitStats                    []int64
}

func (a *DispatchArgs) check(R int) error {
	T, K, H, M, E := a.NumTokens, a.NumTopk, a.Hidden, a.MaxTokens, a.NumExperts
	L, RM := E/R, R*M
	rowBytes := H
	if !a.UseFP8 {
		rowBytes = 2 * H
	}
	S := H / ScaleBlock
	if a.UseUE8M0 {
		S = (S + 3) / 4
	}
	switch {
	case T < 0 || T > M:
		return invalid("x: %d tokens, expected at most num_max_dispatch_tokens_per_rank = %d", T, M)
	case K < 1 || K > MaxTopk:
		return invalid("topk_idx: %d experts a token, expected 1 to %d", K, MaxTopk)
	case a.UseUE8M0 && !(a.UseFP8 && a.RoundScale):
		return invalid("use_ue8m0=True needs use_fp8=True and round_scale=True")
	case len(a.X) < T*H || len(a.TopkIdx) < T*K:
		return invalid("x or topk_idx is smaller than [%d, %d] and [%d, %d]", T, H, T, K)
	case len(a.RecvX) < L*RM*rowBytes || len(a.SrcInfo) < L*RM || len(a.LayoutRange) < L*R || len(a.Count) < L:
		return invalid("dispatch outputs smaller than the layout needs")
	case a.UseFP8 && len(a.RecvScales) < L*RM*S:
		return invalid("recv_x scales: %d words, expected %d", len(a.RecvScales), L*RM*S)
	case a.CumStats != nil && len(a.CumStats) < L:
		return invalid("cumulative_local_expert_recv_stats: %d entries, expected num_local_experts = %d", len(a.CumStats), L)
	case a.WaitStats != nil && len(a.WaitStats) < R:
		return invalid("dispatch_wait_recv_cost_stats: %d entries, expected num_ranks = %d", len(a.WaitStats), R)
	}
	for i, g := range a.TopkIdx[:T*K] {
		if g < -1 || g >= int64(E) {
			return invalid("topk_idx[%d, %d] = %d: expected -1 or an expert in [0, %d)", i/K, i%K, g, E)
		}
		// A second copy would need a slot beyond the M that each (expert, source) pair has.
		if g >= 0 && slices.Contains(a.TopkIdx[i-i%K:i], g) {
			return invalid("topk_idx[%d, %d] = %d: expert %d is selected twice by token %d", i/K, i%K, g, g, i/K)
		}
	}
	return nil
}

// Dispatch runs a dispatch's send phase: every token, in the message format (cast to FP8 once
// in this rank's send area), is written into the slots of the experts it selected in their
// ranks' recv areas, and then the (expert, this rank) flag of every expert of every unmasked
// rank. The returned Recv runs the receive (at once, or as the hook).
func (e *Engine) Dispatch(a *DispatchArgs) (*Recv, error) {
	R := e.d.NumRanks
	if err := a.check(R); err != nil {
		return nil, err
	}
	l, h, seq, err := e.begin("low_latency_dispatch", a.Shape)
	if err != nil {
		return nil, err
	}
	if err := e.dispatchSend(a, l, h, seq); err != nil {
		return nil, err
	}
	return e.pend(h, seq, func() error { return e.dispatchRecv(a, l, h, seq) }), nil
}

func (e *Engine) dispatchSend(a *DispatchArgs, l Layout, h int, seq uint32) error {
	me, base := e.d.Rank, e.d.Regions[e.d.Rank]
	H, K, L, S := a.Hidden, a.NumTopk, l.NumLocalExperts, a.Hidden/ScaleBlock
	msg := func(base unsafe.Pointer, off int64) []byte {
		return unsafe.Slice((*byte)(at(base, off)), l.DispatchMsgBytes)
	}
	for t := range a.NumTokens {
		m := msg(base, l.Send(h)+int64(t)*l.DispatchMsgBytes)
		*(*int32)(unsafe.Pointer(&m[0])) = int32(t)
		x := a.X[t*H : (t+1)*H]
		if a.UseFP8 {
			castFP8(x, m[MsgHeaderBytes:MsgHeaderBytes+H], unsafe.Slice((*float32)(unsafe.Pointer(&m[MsgHeaderBytes+H])), S), a.RoundScale)
		} else {
			copy(m[MsgHeaderBytes:], unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 2*H))
		}
	}
	counts := make([]uint32, a.NumExperts)
	for dst := range e.d.NumRanks {
		ok, err := e.awaitAck("low_latency_dispatch", l, h, seq, dst)
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		for t := range a.NumTokens {
			for _, g := range a.TopkIdx[t*K : (t+1)*K] {
				if g < 0 || int(g)/L != dst {
					continue
				}
				slot := counts[g]
				counts[g]++
				e.write(dst, l.DispatchSlot(h, int(g)%L, me, int(slot)), msg(base, l.Send(h)+int64(t)*l.DispatchMsgBytes))
			}
		}
		// The flags go after the rows (signal orders the writes before it).
		for j := range L {
			e.signal(dst, l.DispatchFlags(h)+8*int64(j*e.d.NumRanks+me), flag(seq, counts[dst*L+j]))
		}
	}
	return e.unsignalled("low_latency_dispatch")
}

func (e *Engine) dispatchRecv(a *DispatchArgs, l Layout, h int, seq uint32) error {
	R, M, H, L := e.d.NumRanks, a.MaxTokens, a.Hidden, l.NumLocalExperts
	RM, base := R*M, e.d.Regions[e.d.Rank]
	rowBytes, S, perWord := 2*H, H/ScaleBlock, 1
	if a.UseFP8 {
		rowBytes = H
	}
	if a.UseUE8M0 {
		perWord = 4
	}
	words := (S + perWord - 1) / perWord
	for j := range L {
		begin := 0
		for src := range R {
			n := 0
			if !e.Masked(src) {
				fw := e.word(e.d.Rank, l.DispatchFlags(h)+8*int64(j*R+src))
				ok, spent, err := e.wait(src, func() string {
					return fmt.Sprintf("low_latency_dispatch: waiting for its tokens for local expert %d (call %d)", j, seq)
				}, func() bool { return uint32(fw.Load()>>32) == seq })
				if err != nil {
					return err
				}
				if a.WaitStats != nil {
					a.WaitStats[src] += spent.Nanoseconds()
				}
				if ok {
					n = int(uint32(fw.Load()))
				}
			}
			if n > M {
				return fmt.Errorf("low_latency_dispatch: rank %d sent %d tokens for local expert %d, more than num_max_dispatch_tokens_per_rank = %d", src, n, j, M)
			}
			for i := range n {
				m := unsafe.Slice((*byte)(at(base, l.DispatchSlot(h, j, src, i))), l.DispatchMsgBytes)
				row := j*RM + begin + i
				a.SrcInfo[row] = *(*int32)(unsafe.Pointer(&m[0]))
				copy(a.RecvX[row*rowBytes:(row+1)*rowBytes], m[MsgHeaderBytes:MsgHeaderBytes+rowBytes])
				if !a.UseFP8 {
					continue
				}
				scales := unsafe.Slice((*float32)(unsafe.Pointer(&m[MsgHeaderBytes+H])), S)
				for s := 0; s < words*perWord; s += perWord {
					out := &a.RecvScales[(j*words+s/perWord)*RM+begin+i]
					if !a.UseUE8M0 {
						*out = *(*uint32)(unsafe.Pointer(&scales[s]))
						continue
					}
					w := uint32(0)
					for b := 0; b < 4 && s+b < S; b++ {
						w |= uint32(ue8m0(scales[s+b])) << (8 * b)
					}
					*out = w
				}
			}
			a.LayoutRange[j*R+src] = int64(begin)<<32 | int64(n)
			begin += n
		}
		a.Count[j] = int32(begin)
		if a.CumStats != nil {
			a.CumStats[j] += int32(begin)
		}
	}
	e.acknowledge(l, h, seq)
	return nil
}
