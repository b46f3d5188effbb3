package cudanormal

import (
	"fmt"

	"github.com/pyep/pyep/goep"
)

// Where the rings and the count exchange lie in every rank's data region.

func align(n, a int64) int64 { return (n + a - 1) / a * a }

// ringWords is the kernels' kSubRings: tail and head words per ring, the most sub-rings a ring
// is split into (one per sending warp of a peer).
const ringWords = 32

// counters is the size of the tails (u64) and heads (u32) of C*R rings, and where the heads start.
func counters(numChannels, numRanks int) (headOff, total int64) {
	words := int64(numChannels) * int64(numRanks) * ringWords
	headOff = align(8*words, 128)
	return headOff, headOff + align(4*words, 128)
}

// notifyScratch is the size of one sender's block and of the whole scratch.
func notifyScratch(numRanks, numChannels, numExperts int) (block, total int64) {
	block = align(32+4*int64(numRanks+numChannels+numExperts/numRanks+1), 16)
	return block, block * int64(numRanks)
}

// dispatchLayout places the dispatch rings' fields after the counters.
func dispatchLayout(numChannels, numRanks, slots, hiddenBytes, scalesBytes, topk int) (off [5]int64, end int64) {
	_, pos := counters(numChannels, numRanks)
	s := int64(numChannels) * int64(numRanks) * int64(slots)
	for i, size := range []int64{int64(hiddenBytes), int64(scalesBytes), 4, 8 * int64(topk), 4 * int64(topk)} {
		off[i] = pos
		pos += align(s*size, 128)
	}
	return off, pos
}

// combineLayout places the combine rings' fields after the counters.
func combineLayout(numChannels, numRanks, slots, rowBytes, topk int) (off [3]int64, end int64) {
	_, pos := counters(numChannels, numRanks)
	s := int64(numChannels) * int64(numRanks) * int64(slots)
	for i, size := range []int64{int64(rowBytes), 4, 4 * int64(topk)} {
		off[i] = pos
		pos += align(s*size, 128)
	}
	return off, pos
}

// vecBytes is the widest vector (16, 8, 4, 2 or 1 bytes) that divides rowBytes and every
// address.
func vecBytes(rowBytes int, addrs ...uint64) int {
	for v := 16; v > 1; v /= 2 {
		ok := rowBytes%v == 0
		for _, a := range addrs {
			ok = ok && a%uint64(v) == 0
		}
		if ok {
			return v
		}
	}
	return 1
}

func tooSmall(op string, rank int, have, need int64, what string) error {
	return goep.Argf("%s: rank %d: num_nvl_bytes = %d is too small: %s need %d bytes (see Config.get_nvl_buffer_size_hint)",
		op, rank, have, what, need)
}

func configString(c goep.Config) string {
	return fmt.Sprintf("Config(num_sms=%d, num_max_nvl_chunked_send_tokens=%d, num_max_nvl_chunked_recv_tokens=%d)",
		c.NumSMs, c.NumMaxNVLChunkedSendTokens, c.NumMaxNVLChunkedRecvTokens)
}
