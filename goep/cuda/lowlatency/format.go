package cudall

import (
	"fmt"
	"math"

	"github.com/pyep/pyep/goep/lowlatency"
)

// msgFormat is the kernels' dispatch message format (kernels/low_latency_dispatch.cuh), which
// differs from the cpu reference's (goep/lowlatency's DispatchMsgBytes: a message a selection): a
// message a (token, destination rank), its body (the row and its scales) at body [src][t] from the
// start of a half's recv area, its header (seq, token, entries (local expert, slot)) at
// Heads + [src][t] * Header. It uses the layout's areas as they are:
//
//   - the bodies (R*M of them) below Heads, the end of a combine's rows ([E][M] of 2H), so that
//     a combine never writes a header's place and a header's place holds nothing but headers;
//   - the headers (room for min(MaxTopk, L) entries: no more are distinct experts of a rank, and
//     the size depends on the shape alone, so that calls of other top-k or dtypes agree on where
//     the headers are) between Heads and the end of the recv area;
//   - for remote peers, the send area stages a body a token and a header a (rank, token).
type msgFormat struct {
	Header, Body, Heads int64
}

// bodyBytes is a message body's bytes: the row, then with FP8 the scales padded to 16 bytes (kBodyBytes).
func bodyBytes(hidden int, fp8 bool) int64 {
	H := int64(hidden)
	if !fp8 {
		return 2 * H
	}
	return H + 16*((H/lowlatency.ScaleBlock+3)/4)
}

// newMsgFormat is l's format for FP8 (or BF16) rows, checked against l's areas.
func newMsgFormat(l lowlatency.Layout, fp8 bool) (msgFormat, error) {
	R, M, L := int64(l.NumRanks), int64(l.MaxTokens), int64(l.NumLocalExperts)
	words := 3 + min(int64(lowlatency.MaxTopk), L) // seq, token, entries, then the entries
	f := msgFormat{Header: (4*words + 15) / 16 * 16, Body: bodyBytes(l.Hidden, fp8), Heads: int64(l.NumExperts) * M * l.CombineMsgBytes}
	switch {
	case L*M > math.MaxInt32:
		// An entry is j * M + slot in an int32.
		return f, fmt.Errorf("num_experts / num_ranks * num_max_dispatch_tokens_per_rank = %d: the cuda backend's low-latency "+
			"dispatch takes at most %d: %w", L*M, math.MaxInt32, lowlatency.ErrInvalid)
	case R*M*f.Body > f.Heads || f.Heads+R*M*f.Header > l.RecvBytes || M*f.Body+R*M*f.Header > l.SendBytes:
		return f, fmt.Errorf("pyep: cuda: low-latency dispatch messages (%d-byte headers, %d-byte bodies) do not fit %v", f.Header, f.Body, l)
	}
	return f, nil
}
