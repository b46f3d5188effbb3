package lowlatency

import (
	"fmt"
	"unsafe"
)

// The low-latency region of every rank (num_rdma_bytes, zeroed at allocation) is laid out as
// below, the same on every rank, so that a rank finds a peer's slot at the same offset from
// that peer's base pointer (Domain.Regions, the per-peer pointer table; a CUDA kernel gets the
// same table, and a peer on another node is later reached at the same offset through NVSHMEM).
// All offsets are in bytes and multiples of 128; R = num_ranks, E = num_experts, L = E/R local
// experts, M = num_max_dispatch_tokens_per_rank, H = hidden.
//
//	Header (HeaderBytes(R); depends on R only, so it survives a change of shape)
//	  sync [R]uint64        sync[p]: the latest barrier epoch rank p reached (written by p)
//	  ack  [2][R]uint64     ack[h][p]: the seq of the latest call on half h whose rows rank p
//	                        has finished reading (written by p when its receive ends)
//	  mask [R]int32         this rank's own mask (1: rank p is masked); peers never write it
//	Half h = 0, 1 (at HeaderBytes + h*HalfBytes), one per call in turn
//	  dispatch flags [E]uint64   at [j*R + src] (j: this rank's local expert): seq<<32 | tokens
//	                             that src wrote for j, stored after those tokens
//	  combine flags  [E]uint64   at [src] (the first R words): seq<<32 | 1, stored after every
//	                             row that src sends this rank for the call
//	  dispatch done  [R]uint64   at [src] (the cuda kernels'): the shares of K = 1<<20 that src's
//	                             blocks added once their messages were written, K a dispatch call
//	                             on the half, so it reaches n*K once src's whole send of the half's
//	                             n-th dispatch call is written; those kernels store the flags early
//	                             and read them after it (docs/low-latency.md, "Ordering")
//	  send [SendBytes]      this rank's own staging: dispatch messages [M], or the rows
//	                        [L][R*M][H] bf16 that a zero-copy combine sends
//	  recv [RecvBytes]      dispatch: messages [L][R][M] ([local expert][source rank][slot]);
//	                        combine: rows [R][M] ([sender][token]) of H bf16, each the sender's
//	                        term of the token (see Combine)
//	  push [PushBytes]      combine: flags [R]uint64 at [src]: seq<<32 | tokens of src, stored
//	                        after src's selections [R][M][MaxTopk]uint64 at [src][t][k]: the
//	                        int32 expert (-1: none, or k >= src's top-k) in the low word, the
//	                        float32 weight's bits in the high word
//
// A dispatch message is DispatchMsgBytes: int32 source token index, 3 int32 reserved, then the
// token (H bytes of FP8 and H/128 float32 scales, or 2H bytes of BF16).
//
// Calls alternate halves: call n (n = 1, 2, ... since the last clean) uses half (n-1)%2 and
// writes its flags with seq = n. A receiver waits until a flag's seq equals its call's, so no
// flag is ever zeroed between calls and a flag of call n-2 can never be taken for call n.
// Before a rank writes into peer p's half h for call n, it waits until ack[h][p] >= n-2 in its
// own header: p has finished reading what call n-2 left there.

const (
	align = 128
	// MsgHeaderBytes is the header of a dispatch message (source token index + reserved).
	MsgHeaderBytes = 16
	// ScaleBlock is the channels that share one FP8 scale.
	ScaleBlock = 128
	// MaxTopk is the most experts a token may select (DeepEP's kNumMaxTopK).
	MaxTopk = 11
)

func alignUp(n int64) int64 { return (n + align - 1) / align * align }

// HeaderBytes is the size of the header of a region shared by numRanks ranks.
func HeaderBytes(numRanks int) int64 {
	R := int64(numRanks)
	return alignUp(8*R) + alignUp(16*R) + alignUp(4*R)
}

// Shape is what a layout depends on besides the rank count; a call with another shape than the
// previous one needs clean_low_latency_buffer first.
type Shape struct {
	MaxTokens, Hidden, NumExperts int
}

// Layout holds the offsets of one shape's layout.
type Layout struct {
	Shape
	NumRanks, NumLocalExperts          int
	DispatchMsgBytes, CombineMsgBytes  int64
	FlagBytes, DoneBytes               int64
	SendBytes, RecvBytes               int64
	PushBytes                          int64
	HalfBytes, TotalBytes              int64
	syncOff, ackOff, maskOff, halfBase int64
}

// NewLayout checks the shape against DeepEP's rules and computes its layout.
func NewLayout(numRanks int, s Shape) (Layout, error) {
	switch {
	case numRanks < 1:
		return Layout{}, invalid("num_ranks = %d: expected >= 1", numRanks)
	case s.MaxTokens < 1:
		return Layout{}, invalid("num_max_dispatch_tokens_per_rank = %d: expected >= 1", s.MaxTokens)
	case s.Hidden < ScaleBlock || s.Hidden%ScaleBlock != 0:
		return Layout{}, invalid("hidden = %d: expected a positive multiple of %d", s.Hidden, ScaleBlock)
	case s.NumExperts < 1 || s.NumExperts%numRanks != 0:
		return Layout{}, invalid("num_experts = %d: expected a positive multiple of num_ranks = %d", s.NumExperts, numRanks)
	case int64(s.MaxTokens) > 1<<31/int64(numRanks):
		return Layout{}, invalid("num_max_dispatch_tokens_per_rank = %d: num_ranks * it must fit an int32", s.MaxTokens)
	}
	R, E, M, H := int64(numRanks), int64(s.NumExperts), int64(s.MaxTokens), int64(s.Hidden)
	l := Layout{Shape: s, NumRanks: numRanks, NumLocalExperts: s.NumExperts / numRanks}
	l.DispatchMsgBytes = MsgHeaderBytes + max(2*H, H+4*(H/ScaleBlock))
	l.CombineMsgBytes = 2 * H
	l.FlagBytes = alignUp(8 * E)
	l.DoneBytes = alignUp(8 * R)
	l.SendBytes = alignUp(max(M*l.DispatchMsgBytes, E*M*l.CombineMsgBytes))
	l.RecvBytes = alignUp(E * M * max(l.DispatchMsgBytes, l.CombineMsgBytes))
	l.PushBytes = alignUp(8*R) + alignUp(8*R*M*MaxTopk)
	l.HalfBytes = 2*l.FlagBytes + l.DoneBytes + l.SendBytes + l.RecvBytes + l.PushBytes
	l.syncOff, l.ackOff, l.maskOff = 0, alignUp(8*R), alignUp(8*R)+alignUp(16*R)
	l.halfBase = HeaderBytes(numRanks)
	l.TotalBytes = l.halfBase + 2*l.HalfBytes
	return l, nil
}

// SizeHint is the num_rdma_bytes that a shape needs (get_low_latency_rdma_size_hint).
func SizeHint(numRanks int, s Shape) (int64, error) {
	l, err := NewLayout(numRanks, s)
	return l.TotalBytes, err
}

// Fits checks that the layout fits a region of numBytes.
func (l Layout) Fits(numBytes int64) error {
	if l.TotalBytes > numBytes {
		return invalid("num_max_dispatch_tokens_per_rank = %d, hidden = %d, num_experts = %d need %d bytes of the low-latency "+
			"buffer, but num_rdma_bytes = %d (see Buffer.get_low_latency_rdma_size_hint)", l.MaxTokens, l.Hidden, l.NumExperts,
			l.TotalBytes, numBytes)
	}
	return nil
}

// Offsets of the header's words and of half h's areas, from a region's base.

func (l Layout) Sync(p int) int64          { return l.syncOff + 8*int64(p) }
func (l Layout) Ack(h, p int) int64        { return l.ackOff + 8*int64(h*l.NumRanks+p) }
func (l Layout) Mask(p int) int64          { return l.maskOff + 4*int64(p) }
func (l Layout) half(h int) int64          { return l.halfBase + int64(h)*l.HalfBytes }
func (l Layout) DispatchFlags(h int) int64 { return l.half(h) }
func (l Layout) CombineFlags(h int) int64  { return l.half(h) + l.FlagBytes }
func (l Layout) DispatchDone(h int) int64  { return l.half(h) + 2*l.FlagBytes }
func (l Layout) Send(h int) int64          { return l.DispatchDone(h) + l.DoneBytes }
func (l Layout) Recv(h int) int64          { return l.Send(h) + l.SendBytes }
func (l Layout) Push(h int) int64          { return l.Recv(h) + l.RecvBytes }

// PushFlag is the offset of src's push flag in half h; PushEntry of src's selection k of token t.
func (l Layout) PushFlag(h, src int) int64 { return l.Push(h) + 8*int64(src) }
func (l Layout) PushEntry(h, src, t, k int) int64 {
	return l.Push(h) + alignUp(8*int64(l.NumRanks)) + 8*((int64(src)*int64(l.MaxTokens)+int64(t))*MaxTopk+int64(k))
}

// DispatchSlot is the offset of slot i of (local expert j, source src) in half h's recv area.
func (l Layout) DispatchSlot(h, j, src, i int) int64 {
	return l.Recv(h) + (int64(j*l.NumRanks+src)*int64(l.MaxTokens)+int64(i))*l.DispatchMsgBytes
}

// CombineSlot is the offset of token t's row from rank src in half h's recv area.
func (l Layout) CombineSlot(h, src, t int) int64 {
	return l.Recv(h) + (int64(src)*int64(l.MaxTokens)+int64(t))*l.CombineMsgBytes
}

func at(base unsafe.Pointer, off int64) unsafe.Pointer { return unsafe.Add(base, off) }

func (l Layout) String() string {
	return fmt.Sprintf("ll layout R=%d M=%d H=%d E=%d: half %d bytes, total %d", l.NumRanks, l.MaxTokens, l.Hidden,
		l.NumExperts, l.HalfBytes, l.TotalBytes)
}
