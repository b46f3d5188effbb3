package pyep

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/pyep/pyep/goep"
)

// Low-latency-mode exports. Tensors cross as data addresses: the Python layer (_low_latency.py)
// checks their dtypes, shapes and devices and allocates the outputs; goep checks the sizes.

// LowLatencySizeHint is get_low_latency_rdma_size_hint.
func LowLatencySizeHint(maxTokens, hidden, numRanks, numExperts int) (n int64, err error) {
	defer guard("LowLatencySizeHint", &err)
	return goep.LowLatencySizeHint(maxTokens, hidden, numRanks, numExperts)
}

// LowLatencyDispatch runs low_latency_dispatch; with hook only its send phase. It returns the
// call's seq (for LowLatencyReceive).
func LowLatencyDispatch(id int64, maxTokens, hidden, numExperts, numTokens, numTopk int,
	useFP8, roundScale, useUE8M0, hook bool,
	x, topkIdx, recvX, recvScales, srcInfo, layoutRange, count, cumStats, waitStats, stream uintptr) (seq int64, err error) {
	entered()
	defer guard("LowLatencyDispatch", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	s, err := b.LowLatencyDispatch(&goep.LLDispatchArgs{MaxTokens: maxTokens, Hidden: hidden, NumExperts: numExperts,
		NumTokens: numTokens, NumTopk: numTopk, UseFP8: useFP8, RoundScale: roundScale, UseUE8M0: useUE8M0, Hook: hook,
		X: x, TopkIdx: topkIdx, RecvX: recvX, RecvScales: recvScales, SrcInfo: srcInfo, LayoutRange: layoutRange,
		Count: count, CumStats: cumStats, WaitStats: waitStats, Stream: stream})
	return int64(s), err
}

// LowLatencyCombine runs low_latency_combine; with hook only its send phase.
func LowLatencyCombine(id int64, maxTokens, hidden, numExperts, numTokens, numTopk int, zeroCopy, hook, logfmt bool,
	x, topkIdx, topkWeights, srcInfo, layoutRange, out, waitStats, stream uintptr) (seq int64, err error) {
	entered()
	defer guard("LowLatencyCombine", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	s, err := b.LowLatencyCombine(&goep.LLCombineArgs{MaxTokens: maxTokens, Hidden: hidden, NumExperts: numExperts,
		NumTokens: numTokens, NumTopk: numTopk, ZeroCopy: zeroCopy, Hook: hook, LogFMT: logfmt, X: x, TopkIdx: topkIdx,
		TopkWeights: topkWeights, SrcInfo: srcInfo, LayoutRange: layoutRange, Out: out, WaitStats: waitStats, Stream: stream})
	return int64(s), err
}

// LowLatencyReceive is the receive hook of call seq (on cuda, queued on stream).
func LowLatencyReceive(id, seq int64, stream uintptr) (err error) {
	entered()
	defer guard("LowLatencyReceive", &err)
	b, err := lookup(id)
	if err != nil {
		return err
	}
	return b.LowLatencyReceive(uint32(seq), stream)
}

// LowLatencyTimedOut is the space-separated ranks masked since the last call because they did
// not answer in time ("" for none).
func LowLatencyTimedOut(id int64) (ranks string, err error) {
	defer guard("LowLatencyTimedOut", &err)
	b, err := lookup(id)
	if err != nil {
		return "", err
	}
	r, err := b.LowLatencyTimedOut()
	return strings.Trim(fmt.Sprint(r), "[]"), err
}

// LowLatencyTimeout sets the buffer's low-latency timeout, in seconds.
func LowLatencyTimeout(id int64, seconds float64) (err error) {
	defer guard("LowLatencyTimeout", &err)
	b, err := lookup(id)
	if err != nil {
		return err
	}
	return b.SetLowLatencyTimeout(time.Duration(seconds * float64(time.Second)))
}

// LowLatencyClean is clean_low_latency_buffer.
func LowLatencyClean(id int64, maxTokens, hidden, numExperts int) (err error) {
	defer guard("LowLatencyClean", &err)
	b, err := lookup(id)
	if err != nil {
		return err
	}
	return b.LowLatencyClean(maxTokens, hidden, numExperts)
}

// LowLatencyNextCombineBuffer is the byte offset in the RDMA buffer of the next zero-copy
// combine's rows.
func LowLatencyNextCombineBuffer(id int64, maxTokens, hidden, numExperts int) (off int64, err error) {
	defer guard("LowLatencyNextCombineBuffer", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	return b.LowLatencyNextCombineBuffer(maxTokens, hidden, numExperts)
}

// LowLatencyMask is low_latency_update_mask_buffer (rank >= 0), low_latency_clean_mask_buffer
// (rank = -1) or low_latency_query_mask_buffer (query: the int32 [num_ranks] output's address).
func LowLatencyMask(id int64, op string, rank int, mask bool, query uintptr) (err error) {
	defer guard("LowLatencyMask", &err)
	b, err := lookup(id)
	if err != nil {
		return err
	}
	return b.LowLatencyMask(op, rank, mask, query)
}

// LowLatencyTimeline reads and clears the low-latency kernels' timeline (PYEP_LL_TIMELINE=1; see
// goep.Buffer.LowLatencyTimeline), as JSON: {"kernels": [...], "phases": [...], "stamps":
// [[ns a stamp] a block]}, ns after the earliest stamp, -1 where absent.
func LowLatencyTimeline(id int64) (js string, err error) {
	defer guard("LowLatencyTimeline", &err)
	b, err := lookup(id)
	if err != nil {
		return "", err
	}
	t, err := b.LowLatencyTimeline()
	if err != nil {
		return "", err
	}
	out, err := json.Marshal(struct {
		Kernels []string  `json:"kernels"`
		Phases  []string  `json:"phases"`
		Stamps  [][]int64 `json:"stamps"`
	}{t.Kernels, t.Phases, t.Stamps})
	return string(out), err
}
