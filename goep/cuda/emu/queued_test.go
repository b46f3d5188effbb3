//go:build cgo

package emu_test

import (
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/dlpack"
)

// The queued dispatch (NotifyDispatch) is one launch of intranode.cu's pyep_notify_dispatch:
// block 0 runs notify and publishes its verdict, the data blocks wait for it (bounded, polling the
// abort word) and run only on a go. These tests run it with every block resident and with blocks
// that are not (a data block that waited for a later block of its kernel would hang), with rows
// that fit and rows that do not (runCase's runQueued), with a rank's invalid arguments, and with
// a rank that never comes.

func TestEmulatedQueuedDispatch(t *testing.T) {
	for _, tt := range []struct {
		name     string
		resident string // PYEP_EMU_RESIDENT_BLOCKS
		c        rcase
	}{
		{"R2", "", rcase{R: 2, T: 40, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}},
		// Rings that hold a channel's tokens, so that the ring kernels need no block of a later
		// channel either (TestEmulatedConsecutiveCalls).
		{"R2_resident_1", "1", rcase{R: 2, T: 40, E: 8, K: 4, hidden: 128, dtype: bf16, cfg: cfg(4, 2, 64), align: 1}},
		{"R3_resident_2", "2", rcase{R: 3, T: 30, E: 9, K: 3, hidden: 64, dtype: bf16, cfg: cfg(6, 2, 64), align: 2}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("PYEP_EMU_RESIDENT_BLOCKS", tt.resident)
			envs := newDomain(t, tt.c.R, 8<<20)
			runCase(t, envs, tt.c) // its queued dispatches: rows that fit, then rows that do not
			queuedBadArgument(t, envs, tt.c)
			runCase(t, envs, tt.c) // the buffer still works
		})
	}
}

// queuedDispatch is every rank's NotifyDispatch of ops into capacity rows each; it returns the
// errors and the tensors the data blocks would write.
func queuedDispatch(t *testing.T, envs []*rankEnv, c rcase, ops []*goep.NotifyOp, capacity int, only ...int) ([]error, []dev) {
	R, K, E := c.R, c.K, c.E
	recv := make([]dev, R)
	dops := make([]*goep.DispatchOp, R)
	for r, e := range envs {
		_, w, x, _ := c.inputs(r)
		T := int64(c.tokens(r))
		recv[r] = e.alloc(t, c.dtype, int64(capacity), int64(c.hidden))
		ops[r].Capacity = capacity
		dops[r] = &goep.DispatchOp{Config: c.cfg, NumTokens: int(T), HiddenBytes: c.hidden * c.dtype.Size(), NumTopk: K,
			NumExperts: E, X: e.upload(t, c.dtype, x, T, int64(c.hidden)).t, TopkIdx: ops[r].TopkIdx,
			TopkWeights: e.upload(t, dlpack.F32, bytesOf(w), T, int64(K)).t, InRank: ops[r].InRank,
			RankPrefix: ops[r].RankPrefix, ChannelPrefix: ops[r].ChannelPrefix, RecvX: recv[r].t,
			RecvSrcIdx: e.alloc(t, dlpack.I32, int64(capacity)).t, RecvTopkIdx: e.alloc(t, dlpack.I64, int64(capacity), int64(K)).t,
			RecvTopkWeights: e.alloc(t, dlpack.F32, int64(capacity), int64(K)).t, SendHead: e.alloc(t, dlpack.I32, T, int64(R)).t}
	}
	errs := eachOf(R, only, nil, func(r int) error {
		peers, err := envs[r].buf.Peers()
		if err != nil {
			return err
		}
		_, ran, err := envs[r].normal().(goep.SpeculativeEngine).NotifyDispatch(peers, ops[r], dops[r])
		assert.False(t, ran && err != nil, "rank %d: ran and failed", r)
		return err
	})
	return errs, recv
}

// queuedBadArgument: an expert index out of range on the last rank, rows that fit everywhere. No
// rank's data blocks move a row; the rank at fault says which index, the others name it.
func queuedBadArgument(t *testing.T, envs []*rankEnv, c rcase) {
	ops := notifyOps(t, envs, c)
	bad := c.R - 1
	idx := unsafe.Slice((*int64)(ops[bad].TopkIdx.Data), c.tokens(bad)*c.K)
	idx[3*c.K+1] = int64(c.E + 5)
	errs, recv := queuedDispatch(t, envs, c, ops, c.R*c.T)
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		if r == bad {
			assert.True(t, goep.IsArgument(err))
			assert.ErrorContains(t, err, "topk_idx[3,1]")
		} else {
			assert.False(t, goep.IsArgument(err))
			assert.ErrorContains(t, err, "has invalid arguments")
		}
		assert.True(t, untouched(recv[r].b), "rank %d: recv_x written by a dispatch that did not run", r)
	}
}

// TestEmulatedQueuedPeerAbsent: rank 1 never makes its queued dispatch. Rank 0's kernel stops
// within the timeout (block 0 in notify's barrier, the data blocks waiting for that barrier), and
// its error names rank 1; then rank 1's call stops at once, naming rank 0's failure, and every
// later call says the buffer failed.
func TestEmulatedQueuedPeerAbsent(t *testing.T) {
	for _, resident := range []string{"", "1"} {
		t.Run("resident_"+resident, func(t *testing.T) {
			t.Setenv("PYEP_EMU_RESIDENT_BLOCKS", resident)
			c := rcase{R: 2, T: 30, E: 8, K: 3, hidden: 64, dtype: bf16, cfg: cfg(4, 2, 64), align: 1}
			envs := newDomain(t, c.R, 8<<20)
			timeout := goep.OpTimeout()
			defer goep.SetOpTimeout(timeout)
			goep.SetOpTimeout(300 * time.Millisecond)
			start := time.Now()
			errs, _ := queuedDispatch(t, envs, c, notifyOps(t, envs, c), c.R*c.T, 0)
			require.Error(t, errs[0])
			t.Log(errs[0])
			// Bounded, not hung; the bound also covers the emulator's cold compile of the kernel (5-15 s
			// on a busy 2-core machine).
			assert.Less(t, time.Since(start), 60*time.Second)
			assert.ErrorContains(t, errs[0], "dispatch")
			assert.ErrorContains(t, errs[0], "rank 0")
			assert.ErrorContains(t, errs[0], "timed out after")
			assert.ErrorContains(t, errs[0], "waiting for rank 1 to join the call")

			errs, _ = queuedDispatch(t, envs, c, notifyOps(t, envs, c), c.R*c.T, 1)
			require.Error(t, errs[1])
			t.Log(errs[1])
			assert.ErrorContains(t, errs[1], "stopped because rank 0 timed out waiting for rank 1")
			errs, _ = queuedDispatch(t, envs, c, notifyOps(t, envs, c), c.R*c.T, 0)
			assert.ErrorContains(t, errs[0], "failed earlier")
		})
	}
}
