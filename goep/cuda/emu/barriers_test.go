//go:build cgo

package emu_test

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
)

// A cached dispatch and a combine are one launch each: the kernel passes the call's two barriers
// and resets the counters itself (intranode.cu's call_barriers), block 0 for the rank while the
// other blocks wait for the second barrier. These tests run many such calls in a row, with blocks
// that are not all resident at once, and with peers that come late, never come, or fail in the
// barriers.

// TestEmulatedConsecutiveCalls alternates cached dispatches and combines on one handle, new
// inputs every round, so that a counter left over from the call before would show in the rows;
// then the whole case again (notify's barriers numbered after theirs). With resident blocks set,
// every launch runs that many blocks at a time, in block order, as a GPU (or an MPS client's
// share of one) that holds fewer blocks than the grid: a block that waited for a later block of
// its kernel would hang there. Those cases' rings hold a channel's tokens, so that the ring
// kernels need no block of a later channel either.
func TestEmulatedConsecutiveCalls(t *testing.T) {
	for _, tt := range []struct {
		name     string
		resident string // PYEP_EMU_RESIDENT_BLOCKS
		c        rcase
		rounds   int
		again    bool // the whole case again after the rounds
	}{
		{"R2", "", rcase{R: 2, T: 70, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}, 8, true},
		{"R3_resident_1", "1", rcase{R: 3, T: 40, E: 9, K: 4, hidden: 128, dtype: bf16, cfg: cfg(4, 2, 64), align: 1, bias: 1},
			3, true},
		{"R2_resident_3_worst", "3", rcase{R: 2, T: 36, E: 8, K: 4, hidden: 64, dtype: bf16, cfg: cfg(6, 2, 64), align: 1,
			worst: 2}, 2, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("PYEP_EMU_RESIDENT_BLOCKS", tt.resident)
			envs := newDomain(t, tt.c.R, 8<<20)
			rounds := runCase(t, envs, tt.c)
			for n := 1; n <= tt.rounds; n++ {
				noErrors(t, rounds.cached(n))
				noErrors(t, rounds.combine(n))
			}
			// Two of a kind in a row.
			noErrors(t, rounds.combine(tt.rounds+1))
			noErrors(t, rounds.combine(tt.rounds+2))
			noErrors(t, rounds.cached(tt.rounds+3))
			noErrors(t, rounds.cached(tt.rounds+4))
			if tt.again {
				runCase(t, envs, tt.c)
			}
		})
	}
}

// TestEmulatedBarrierPeerLate: a rank that comes to a cached dispatch or a combine well after the
// others, within the timeout, holds them in the barrier; every rank's rows are right.
func TestEmulatedBarrierPeerLate(t *testing.T) {
	c := rcase{R: 3, T: 30, E: 9, K: 3, hidden: 64, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}
	envs := newDomain(t, c.R, 8<<20)
	rounds := runCase(t, envs, c)
	late := c.R - 1
	for n, call := range []func(int, ...int) []error{rounds.cached, rounds.combine} {
		arrived := watchSignals(envs, late, 0, 1)
		rounds.before = func(r int) {
			if r == late {
				arrived() // ranks 0 and 1 are in the barrier
				time.Sleep(300 * time.Millisecond)
			}
		}
		noErrors(t, call(n+1))
		rounds.before = nil
		require.True(t, arrived(), "ranks 0 and 1 arrived at the barrier")
		noErrors(t, call(n+3)) // and no failure was recorded
	}
}

// TestEmulatedBarrierFailures: a peer that never makes a cached dispatch or a combine, or that
// fails in the kernel's barriers. The ranks in the call stop within the timeout, and the next
// call of each says why, naming the rank at fault.
func TestEmulatedBarrierFailures(t *testing.T) {
	c := rcase{R: 3, T: 30, E: 9, K: 3, hidden: 64, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}
	timeout := goep.OpTimeout()
	defer goep.SetOpTimeout(timeout)
	for _, op := range []string{"dispatch", "combine"} {
		call := func(rounds *caseRounds) func(int, ...int) []error {
			if op == "dispatch" {
				return rounds.cached
			}
			return rounds.combine
		}
		// Rank 2 never comes: ranks 0 and 1 time out in the barriers (whichever block of a rank
		// gives up first: block 0 in a barrier, or a block waiting for the second) and name it.
		t.Run(op+"_peer_absent", func(t *testing.T) {
			goep.SetOpTimeout(timeout)
			envs := newDomain(t, c.R, 8<<20)
			call := call(runCase(t, envs, c))
			goep.SetOpTimeout(300 * time.Millisecond)
			start := time.Now()
			noErrors(t, call(1, 0, 1)) // queued: the failure is the next call's
			assert.Less(t, time.Since(start), 5*time.Second)
			errs := call(2, 0, 1)
			timedOut := 0
			for r := range 2 {
				require.Error(t, errs[r], "rank %d", r)
				t.Logf("rank %d: %v", r, errs[r])
				msg := errs[r].Error()
				assert.Contains(t, msg, fmt.Sprintf("%s: rank %d: ", op, r))
				assert.Contains(t, msg, "waiting for rank 2 to join the call")
				if strings.Contains(msg, "timed out after") {
					timedOut++
				} else {
					assert.Contains(t, msg, fmt.Sprintf("stopped because rank %d timed out", 1-r))
				}
			}
			assert.GreaterOrEqual(t, timedOut, 1, "one rank timed out itself")
			// Rank 2's call stops at once: the abort reached its buffer too.
			start = time.Now()
			noErrors(t, call(3, 2))
			assert.Less(t, time.Since(start), 5*time.Second)
			errs = call(4, 2)
			require.Error(t, errs[2])
			t.Log(errs[2])
			assert.Contains(t, errs[2].Error(), op+": rank 2: stopped because rank")
			assert.Contains(t, errs[2].Error(), "waiting for rank 2 to join the call")
			for r, err := range call(5) {
				assert.ErrorContains(t, err, "failed earlier", "rank %d", r)
			}
		})
		// Rank 2 never comes and rank 1 gives up on it first (a shorter timeout): rank 0, which
		// would wait a minute, stops within a poll of rank 1's failure and names both.
		t.Run(op+"_peer_fails_in_barrier", func(t *testing.T) {
			goep.SetOpTimeout(timeout)
			envs := newDomain(t, c.R, 8<<20)
			call := call(runCase(t, envs, c))
			arrived := watchSignals(envs, 0, 1)
			goep.SetOpTimeout(time.Second)
			done := make(chan []error)
			go func() { done <- call(1, 1) }()
			require.True(t, arrived(), "rank 1's kernel (its timeout taken) arrived at the barrier")
			goep.SetOpTimeout(time.Minute)
			start := time.Now()
			errs0 := call(1, 0)
			elapsed := time.Since(start)
			noErrors(t, errs0)
			noErrors(t, <-done)
			assert.Less(t, elapsed, 10*time.Second, "rank 0 stops with rank 1, not at its own timeout")
			errs := call(2, 0, 1)
			require.Error(t, errs[0])
			require.Error(t, errs[1])
			t.Log(errs[0])
			t.Log(errs[1])
			assert.Contains(t, errs[0].Error(), op+": rank 0: stopped because rank 1 timed out waiting for rank 2 to join the call")
			assert.Contains(t, errs[1].Error(), op+": rank 1: timed out after")
			assert.Contains(t, errs[1].Error(), "waiting for rank 2 to join the call (barrier #")
		})
	}
}

// watchSignals returns a wait (at most a minute) until each rank of from has arrived at a barrier
// after now: its signal in rank at's control region (protocol.cuh's kCtlSignals, a u64 a rank at
// the region's start) has risen. It reports whether they did; any goroutine may call it.
func watchSignals(envs []*rankEnv, at int, from ...int) func() bool {
	peers, err := envs[at].buf.Peers()
	if err != nil {
		panic(err)
	}
	words := make([]*uint64, len(from))
	before := make([]uint64, len(from))
	for i, r := range from {
		words[i] = (*uint64)(unsafe.Add(peers[at].Control(), 8*r))
		before[i] = atomic.LoadUint64(words[i])
	}
	return func() bool {
		deadline := time.Now().Add(time.Minute)
		for i, w := range words {
			for atomic.LoadUint64(w) <= before[i] {
				if time.Now().After(deadline) {
					return false
				}
				time.Sleep(time.Millisecond)
			}
		}
		return true
	}
}
