//go:build cgo

package cudanormal

import (
	"fmt"
	"time"

	"github.com/pyep/pyep/goep"
)

// Failures as the kernels record them, in words.

// The ops of protocol.cuh (2, the prologue kernel's, is no more: a cached dispatch's or a combine's
// barriers fail as "dispatch" or "combine").
var opNames = map[int32]string{1: "dispatch (notify)", 3: "dispatch", 4: "combine"}

func describeFailure(r *opError) string {
	code, op, rank, channel, peer, what := uint32(r.code), int32(r.op), int32(r.rank), int32(r.channel), int32(r.peer), int32(r.what)
	a, b, c := int64(r.a), int64(r.b), int64(r.c)
	msg := fmt.Sprintf("%s: rank %d", opNames[op], rank)
	if channel >= 0 {
		msg += fmt.Sprintf(" channel %d", channel)
	}
	switch code {
	case 1:
		return msg + fmt.Sprintf(": timed out after %v waiting for rank %d to %s", time.Duration(r.waited_ns).Round(time.Millisecond),
			peer, waitText(what, a, b, c))
	case 2:
		return msg + ": " + mismatchText(what, peer, a, b, c)
	case 3:
		w := uint64(r.abort_word)
		origin, what, peer := int32(w>>56&0x7f), int32(w>>48&0xff), int32(int8(w>>40&0xff))
		code, channel := uint32(w>>32&0xff), int32(uint32(w))
		cause := "failed"
		switch code {
		case 1:
			cause = fmt.Sprintf("timed out waiting for rank %d to %s", peer, waitText(what, -1, -1, -1))
		case 2:
			cause = "found " + mismatchText(what, peer, -1, -1, -1)
		}
		where := ""
		if channel >= 0 {
			where = fmt.Sprintf(" on channel %d", channel)
		}
		return msg + fmt.Sprintf(": stopped because rank %d %s%s", origin, cause, where)
	}
	return msg + fmt.Sprintf(": failed with code %d", code)
}

func waitText(what int32, a, b, c int64) string {
	known := a >= 0
	switch what {
	case 1:
		if known {
			return fmt.Sprintf("join the call (barrier #%d; it last reached #%d: it did not make this call, or is stuck in an earlier one)", a, b)
		}
		return "join the call (it did not make this call, or is stuck in an earlier one)"
	case 2:
		if known {
			return fmt.Sprintf("push tokens (received %d of %d)", a, b)
		}
		return "push tokens"
	case 3:
		if known {
			return fmt.Sprintf("free ring slots (head %d, pushed %d, ring of %d slots)", a, b, c)
		}
		return "free ring slots"
	case 4:
		return "announce its token count"
	case 5:
		if known {
			return fmt.Sprintf("return token %d (its slot %d, pushed %d)", a, b, c)
		}
		return "return tokens"
	case 6:
		if known {
			return fmt.Sprintf("finish its notify (of barrier #%d; the last one decided was #%d)", a, b)
		}
		return "finish its notify"
	}
	return "make progress"
}

func mismatchText(what, peer int32, a, b, c int64) string {
	known := a >= 0 || b >= 0
	switch what {
	case 10:
		if known {
			return fmt.Sprintf("rank %d sends %d tokens here but rank_prefix_matrix says %d (a handle of another dispatch?)", peer, a, b)
		}
		return fmt.Sprintf("a token count of rank %d that does not match rank_prefix_matrix", peer)
	case 11:
		return fmt.Sprintf("is_token_in_rank routes other tokens to rank %d than channel_prefix_matrix says", peer)
	case 12:
		if known {
			return fmt.Sprintf("the rows [%d, %d) from rank %d do not fit the %d output rows", a, b, peer, c)
		}
		return "more rows than the outputs hold"
	case 13:
		if known {
			return fmt.Sprintf("rank %d returned the row of token %d where send_head expects token %d (a handle of another dispatch?)", peer, a, b)
		}
		return "a returned row of another token than send_head expects"
	case 14:
		if known {
			return fmt.Sprintf("rank %d returns %d rows but send_head expects %d (a handle of another dispatch?)", peer, a, b)
		}
		return "a row count that does not match send_head"
	case 15:
		if known {
			return fmt.Sprintf("channel_prefix_matrix[%d] = %d is not an exclusive prefix within the %d rows from rank %d", peer, a, c, peer)
		}
		return "an invalid channel_prefix_matrix"
	case 16:
		if known {
			return fmt.Sprintf("send_head[%d, %d] = %d but rank %d returns only %d rows", a, peer, b, peer, c)
		}
		return "a send_head beyond what a rank returns"
	}
	return fmt.Sprintf("an inconsistency (%d)", what)
}

// layoutGateTimedOut is the token of layout.cu's record when a block waited past the timeout for
// block 0 (kGateTimedOut's upper half).
const layoutGateTimedOut = 0xffffffff

// statusError is rank's own invalid argument as notify found it.
func statusError(status int32, rank int, d0, d1, d2 int64, numExperts int) error {
	switch status {
	case 1:
		return goep.Argf("dispatch: rank %d: topk_idx[%d,%d] = %d is out of range [0, %d) (or -1 for no expert)", rank, d0, d1, d2, numExperts)
	case 2:
		return goep.Argf("dispatch: rank %d: num_tokens_per_rank[%d] = %d but is_token_in_rank routes %d tokens to rank %d", rank, d0, d1, d2, d0)
	case 3:
		return goep.Argf("dispatch: rank %d: num_tokens_per_expert[%d] = %d is out of range", rank, d0, d1)
	case 6:
		if d0 == layoutGateTimedOut {
			return fmt.Errorf("dispatch: rank %d: its last get_dispatch_layout's blocks waited past the timeout for its "+
				"block 0 (the GPU did not run it): its counts are not valid; call get_dispatch_layout again", rank)
		}
		return goep.Argf("dispatch: rank %d: in its last get_dispatch_layout, topk_idx[%d,%d] = %d is out of range [0, %d) "+
			"(or -1 for no expert); on cuda the layout does not wait for the GPU, so the dispatch after it reports the index", rank, d0, d1, d2, numExperts)
	}
	return fmt.Errorf("dispatch: rank %d: notify status %d", rank, status)
}
