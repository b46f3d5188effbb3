package normal

import (
	"fmt"
	"unsafe"
)

// NotifyArgs are the arguments of Notify, the first phase of a non-cached
// dispatch. Slices alias caller (Python) memory; outputs are caller-allocated.
type NotifyArgs struct {
	Config          Config
	NumTokens       int // T: tokens on this rank
	NumExperts      int // E: all experts of the domain
	ExpertAlignment int // num_recv_tokens_per_expert are aligned up to this (>= 1)
	NumWorstTokens  int // 0, or the receive capacity every rank must fit in

	NumTokensPerRank   []int32 // [R] tokens this rank sends to each rank (from Layout)
	NumTokensPerExpert []int32 // [E] tokens this rank sends to each expert (from Layout)
	IsTokenInRank      []bool  // [T, R]

	RankPrefixMatrix        []int32 // out [R, R]: tokens ranks 0..i send to rank j
	ChannelPrefixMatrix     []int32 // out [R, C]: this rank's tokens to rank j in channels 0..c (inclusive)
	RecvChannelPrefixMatrix []int32 // out [R, C]: tokens rank i sends here in channels 0..c-1 (exclusive)
	NumRecvTokensPerExpert  []int32 // out [E/R]: tokens for each local expert, aligned
}

// NotifyResult is what Notify returns besides the output matrices.
type NotifyResult struct {
	NumRecvTokens int // rows this rank receives: RankPrefixMatrix[R-1][Rank]
	// NumRecvTokensPerRank[j] = rows rank j receives. Identical on all ranks,
	// so every rank reaches the same verdict on NumWorstTokens.
	NumRecvTokensPerRank []int
}

// sendCounts scans is_token_in_rank and returns counts[c*R+dst]: the tokens
// of channel c this rank sends to dst.
func sendCounts(inRank []bool, numTokens, numRanks, numChannels int) []int64 {
	counts := make([]int64, numChannels*numRanks)
	for c := 0; c < numChannels; c++ {
		lo, hi := channelRange(numTokens, numChannels, c)
		row := counts[c*numRanks : (c+1)*numRanks]
		for t := lo; t < hi; t++ {
			for dst, in := range inRank[t*numRanks : (t+1)*numRanks] {
				if in {
					row[dst]++
				}
			}
		}
	}
	return counts
}

// Notify exchanges the token counts of a dispatch: afterwards every rank
// knows how many tokens each rank sends to each rank (RankPrefixMatrix, the
// same everywhere), the per-channel offsets of what it receives, and the
// per-expert counts of its local experts. Python sizes the dispatch outputs
// from the result and then calls Dispatch.
//
// If NumWorstTokens > 0 and any rank would receive more, every rank returns
// the same error (they all see the whole matrix), so no rank is left waiting.
func Notify(d *Domain, a *NotifyArgs) (NotifyResult, error) {
	const op = "notify"
	var res NotifyResult
	if err := d.check(op); err != nil {
		return res, err
	}
	R, me := d.NumRanks, d.Rank
	C := a.Config.NumChannels()
	invalid := a.validate(d)
	ds := desc{op: opNotify, names: []string{"num_sms", "num_experts", "num_worst_tokens", "expert_alignment"},
		vals: []uint64{uint64(a.Config.NumSMs), uint64(a.NumExperts), uint64(a.NumWorstTokens), uint64(a.ExpertAlignment)}}
	var counts []int64
	var lay notifyLayout
	if invalid == nil {
		counts = sendCounts(a.IsTokenInRank, a.NumTokens, R, C)
		for dst := 0; dst < R && invalid == nil; dst++ {
			var sum int64
			for c := 0; c < C; c++ {
				sum += counts[c*R+dst]
			}
			if sum != int64(a.NumTokensPerRank[dst]) {
				invalid = newErr(ErrInvalid, "%s: rank %d: num_tokens_per_rank[%d] = %d but is_token_in_rank routes %d tokens to rank %d",
					op, me, dst, a.NumTokensPerRank[dst], sum, dst)
			}
		}
		lay = newNotifyLayout(R, C, a.NumExperts)
		if invalid == nil {
			invalid = checkBuffer(op, d, lay.total, fmt.Sprintf("the count exchange of %d ranks, %d channels and %d experts would", R, C, a.NumExperts))
		}
	}
	zero := func() {
		for src := 0; src < R; src++ {
			word(d.Buffers[me], lay.flagOff(src)).Store(0)
		}
	}
	body := func(c *call) error {
		epr := a.NumExperts / R
		// The sender-side prefix is local.
		for dst := 0; dst < R; dst++ {
			var run int64
			for ch := 0; ch < C; ch++ {
				run += counts[ch*R+dst]
				a.ChannelPrefixMatrix[dst*C+ch] = int32(run)
			}
		}
		// Publish our block in every receiver's scratch, then its flag.
		for dst := 0; dst < R; dst++ {
			blk := unsafe.Slice((*int32)(unsafe.Add(d.Buffers[dst], lay.blockOff(me))), R+C+epr)
			copy(blk[:R], a.NumTokensPerRank)
			for ch := 0; ch < C; ch++ {
				blk[R+ch] = int32(counts[ch*R+dst])
			}
			copy(blk[R+C:], a.NumTokensPerExpert[dst*epr:(dst+1)*epr])
			word(d.Buffers[dst], lay.flagOff(me)).Store(1)
		}
		// Gather every sender's block from our scratch.
		expSum := make([]int64, epr)
		colSum := make([]int64, R)
		for src := 0; src < R; src++ {
			flag := word(d.Buffers[me], lay.flagOff(src))
			err := c.wait(src, func() bool { return flag.Load() != 0 },
				func() string { return "publish its token counts" })
			if err != nil {
				return err
			}
			blk := unsafe.Slice((*int32)(unsafe.Add(d.Buffers[me], lay.blockOff(src))), R+C+epr)
			for j := 0; j < R; j++ {
				colSum[j] += int64(blk[j])
				a.RankPrefixMatrix[src*R+j] = int32(colSum[j])
			}
			var run int64
			for ch := 0; ch < C; ch++ {
				a.RecvChannelPrefixMatrix[src*C+ch] = int32(run)
				run += int64(blk[R+ch])
			}
			if run != int64(blk[me]) {
				return c.errf(ErrPeer, "rank %d sends %d tokens here by its channel counts but %d by num_tokens_per_rank",
					src, run, blk[me])
			}
			for i := 0; i < epr; i++ {
				expSum[i] += int64(blk[R+C+i])
			}
		}
		for j := 0; j < R; j++ {
			if colSum[j] > maxTokens {
				return verdict{newErr(ErrInvalid, "%s: rank %d would receive %d tokens, more than supported", op, j, colSum[j])}
			}
		}
		for i, n := range expSum {
			n = align(n, int64(a.ExpertAlignment))
			if n > maxTokens {
				return c.errf(ErrInvalid, "local expert %d would receive %d tokens, more than supported", i, n)
			}
			a.NumRecvTokensPerExpert[i] = int32(n)
		}
		res.NumRecvTokens = int(colSum[me])
		res.NumRecvTokensPerRank = make([]int, R)
		worst := -1
		for j := 0; j < R; j++ {
			res.NumRecvTokensPerRank[j] = int(colSum[j])
			if a.NumWorstTokens > 0 && colSum[j] > int64(a.NumWorstTokens) && (worst < 0 || colSum[j] > colSum[worst]) {
				worst = j
			}
		}
		if worst >= 0 {
			// Every rank computes this from the same matrix; the error is
			// deliberately the same text on all ranks (no "rank me" prefix).
			return verdict{newErr(ErrInvalid, "%s: num_worst_tokens = %d is too small: rank %d receives %d tokens",
				op, a.NumWorstTokens, worst, colSum[worst])}
		}
		return nil
	}
	err := d.run(op, ds, invalid, zero, body)
	if err != nil {
		return NotifyResult{}, err
	}
	return res, nil
}

func (a *NotifyArgs) validate(d *Domain) error {
	const op = "notify"
	R, me := d.NumRanks, d.Rank
	if err := a.Config.Validate(); err != nil {
		return newErr(ErrInvalid, "%s: rank %d: %v", op, me, err)
	}
	C := a.Config.NumChannels()
	switch {
	case a.NumTokens < 0 || a.NumTokens > maxTokens:
		return newErr(ErrInvalid, "%s: rank %d: num_tokens = %d is out of range", op, me, a.NumTokens)
	case a.NumExperts <= 0 || a.NumExperts%R != 0:
		return newErr(ErrInvalid, "%s: rank %d: num_experts = %d must be a positive multiple of num_ranks = %d", op, me, a.NumExperts, R)
	case a.ExpertAlignment < 1 || a.ExpertAlignment > 1<<20:
		return newErr(ErrInvalid, "%s: rank %d: expert_alignment = %d must be in [1, 2^20]", op, me, a.ExpertAlignment)
	case a.NumWorstTokens < 0 || a.NumWorstTokens > maxTokens:
		return newErr(ErrInvalid, "%s: rank %d: num_worst_tokens = %d is out of range", op, me, a.NumWorstTokens)
	}
	for _, l := range []struct {
		name      string
		got, want int
	}{
		{"num_tokens_per_rank", len(a.NumTokensPerRank), R},
		{"num_tokens_per_expert", len(a.NumTokensPerExpert), a.NumExperts},
		{"is_token_in_rank", len(a.IsTokenInRank), a.NumTokens * R},
		{"rank_prefix_matrix", len(a.RankPrefixMatrix), R * R},
		{"channel_prefix_matrix", len(a.ChannelPrefixMatrix), R * C},
		{"recv_channel_prefix_matrix", len(a.RecvChannelPrefixMatrix), R * C},
		{"num_recv_tokens_per_expert", len(a.NumRecvTokensPerExpert), a.NumExperts / R},
	} {
		if l.got != l.want {
			return newErr(ErrInvalid, "%s: rank %d: %s has %d elements, want %d", op, me, l.name, l.got, l.want)
		}
	}
	for e, n := range a.NumTokensPerExpert {
		if n < 0 {
			return newErr(ErrInvalid, "%s: rank %d: num_tokens_per_expert[%d] = %d is out of range", op, me, e, n)
		}
	}
	return nil
}
