package cudanormal

import (
	"strconv"

	"github.com/pyep/pyep/goep/env"
)

// debugSync (PYEP_DEBUG_SYNC=1, a debugging aid) makes every launch wait for its kernel and
// name the kernel that failed.
var debugSync = env.Sync()

func itoa(n int) string { return strconv.Itoa(n) }

// The constants each kernel variant is compiled with (the engine's choices; exported for tools
// that fill the kernel cache ahead of time).

// LayoutDefines are layout.cu's for blocks of threads.
func LayoutDefines(threads int) map[string]string {
	return map[string]string{"PYEP_LAYOUT_THREADS": itoa(threads)}
}

// NotifyDefines are notify's (intranode.cu) for numRanks ranks.
func NotifyDefines(numRanks, notifyThreads int) map[string]string {
	return map[string]string{"PYEP_NOTIFY": "", "PYEP_RANKS": itoa(numRanks), "PYEP_NOTIFY_THREADS": itoa(notifyThreads)}
}

// DispatchDefines are the dispatch kernel's: rows of hiddenBytes (+ scalesBytes of scales),
// topk indices per token (0 for a cached dispatch), moved as vec-byte vectors, run in shape s.
func DispatchDefines(numRanks, hiddenBytes, scalesBytes, topk, vec int, s Shape) map[string]string {
	return map[string]string{"PYEP_DISPATCH": "", "PYEP_RANKS": itoa(numRanks), "PYEP_HIDDEN_BYTES": itoa(hiddenBytes),
		"PYEP_SCALES_BYTES": itoa(scalesBytes), "PYEP_TOPK": itoa(topk), "PYEP_VEC": itoa(vec),
		"PYEP_THREADS": itoa(s.Threads), "PYEP_COPY_UNROLL": itoa(s.Unroll), "PYEP_SPLIT_SEND": itoa(splitSend(scalesBytes))}
}

// splitSend is PYEP_SPLIT_SEND (kernels/intranode_dispatch.cuh): 1 where both blocks of a channel
// send and receive, the rows with scales (FP8), 0 where one block sends and the other receives, the
// rows without. An A/B on 2x H200 (4096 tokens, hidden 7168, 24 SMs; pyep.bench µs, 1 vs 0): FP8
// 142.0 vs 147.7, BF16 225.7 vs 220.7, cached BF16 217.8 vs 213.0
// (bench/results/h200x2-2026-11-27-probe).
func splitSend(scalesBytes int) int {
	if scalesBytes > 0 {
		return 1
	}
	return 0
}

// NotifyDispatchDefines are the queued dispatch's kernel's (notify in block 0, then the dispatch's
// blocks), with DispatchDefines' constants.
func NotifyDispatchDefines(numRanks, hiddenBytes, scalesBytes, topk, vec int, s Shape) map[string]string {
	d := DispatchDefines(numRanks, hiddenBytes, scalesBytes, topk, vec, s)
	d["PYEP_NOTIFY"] = ""
	return d
}

// CombineDefines are the combine kernel's: rows of hidden elements of dtype (1 bf16, 2 fp16,
// 3 fp32), topk weights per row (0 for none), the biases added (bit 0 bias_0, bit 1 bias_1),
// vec-byte vectors, run in shape s.
func CombineDefines(numRanks, hidden, dtype, topk, biases, vec int, s Shape) map[string]string {
	return map[string]string{"PYEP_COMBINE": "", "PYEP_RANKS": itoa(numRanks), "PYEP_HIDDEN": itoa(hidden),
		"PYEP_DTYPE": itoa(dtype), "PYEP_TOPK": itoa(topk), "PYEP_BIASES": itoa(biases), "PYEP_VEC": itoa(vec),
		"PYEP_THREADS": itoa(s.Threads), "PYEP_COPY_UNROLL": itoa(s.Unroll)}
}

// combineBiases is PYEP_BIASES for the bias tensors at b0 and b1 (0: none).
func combineBiases(b0, b1 uint64) int {
	n := 0
	if b0 != 0 {
		n |= 1
	}
	if b1 != 0 {
		n |= 2
	}
	return n
}
