//go:build cgo

package emu_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/env"
)

// The timeline build of the low-latency kernels (PYEP_LL_TIMELINE=1): the outputs are still bit
// for bit the reference's, and after each dispatch (combine) every block has stamped every phase
// of that call's kernels, in phase order, and none of the other's (the read cleared them).
func TestEmulatedLowLatencyTimeline(t *testing.T) {
	t.Setenv(env.LLTimeline, "1")
	for _, c := range []llCase{
		{R: 2, T: 6, H: 256, K: 3, E: 8, M: 8, fp8: true},
		{R: 3, T: 5, H: 256, K: 2, E: 6, M: 6, fp8: true, round: true, ue8m0: true, hook: true},
		// rank 1 has no token, and each block flags its 20 of 40 experts in two rounds, the second without tokens
		{R: 2, T: 1, H: 128, K: 1, E: 40, M: 4},
		{R: 2, T: 3, H: 128, K: 1, E: 40, M: 4, fp8: true},
		{R: 2, T: 6, H: 256, K: 2, E: 8, M: 8, perNode: 1, hook: true},
	} {
		t.Run(c.String(), func(t *testing.T) {
			runLL(t, c, func(gpu []*llRank, combine bool) {
				for r, k := range gpu {
					raw, err := k.ll.Timeline()
					require.NoError(t, err)
					checkTimeline(t, raw, combine, r)
				}
			})
		})
	}
}

func checkTimeline(t *testing.T, raw goep.RawLLTimeline, combine bool, rank int) {
	t.Helper()
	require.Len(t, raw.Stamps, 2, "rank %d: a row of stamps a block", rank)
	for b, row := range raw.Stamps {
		require.Len(t, row, len(raw.Kernels))
		var last uint64
		for i, v := range row {
			name := raw.Kernels[i] + ": " + raw.Phases[i]
			if strings.HasPrefix(raw.Kernels[i], "combine") != combine {
				assert.Zero(t, v, "rank %d block %d: %s is another call's", rank, b, name)
				continue
			}
			require.NotZero(t, v, "rank %d block %d: %s", rank, b, name)
			assert.GreaterOrEqual(t, v, last, "rank %d block %d: %s before the phase it follows", rank, b, name)
			last = v
		}
	}
}

// Without PYEP_LL_TIMELINE the engine has no stamps to give.
func TestEmulatedLowLatencyNoTimeline(t *testing.T) {
	t.Setenv(env.LLTimeline, "")
	gpu := newLLDomain(t, 2, 1<<20, remoteOf(2, 0, false))
	_, err := gpu[0].ll.Timeline()
	assert.ErrorIs(t, err, goep.ErrTimelineOff)
}
