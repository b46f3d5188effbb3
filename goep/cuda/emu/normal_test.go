//go:build cgo

package emu_test

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/emu"
	"github.com/pyep/pyep/goep/dlpack"
)

// The normal-mode cases of the emulated engine (runCase), its failures, and shapes of GPU runs.

var bf16 = dlpack.BF16

func TestEmulatedRoundTrip(t *testing.T) {
	cases := []rcase{
		{name: "bf16_R2", R: 2, T: 70, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 2},
		{name: "bf16_R2_one_channel_big_ring", R: 2, T: 33, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(2, 6, 256), align: 4, bias: 1},
		{name: "bf16_R2_worst_uneven", R: 2, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(6, 3, 7), align: 1, worst: 3,
			tokensPer: func(r int) int { return []int{50, 0}[r] }},
		{name: "fp8_R2", R: 2, T: 40, E: 8, K: 4, hidden: 256, dtype: dlpack.FP8E4M3, scales: 2, cfg: cfg(4, 2, 8), align: 1,
			combineDT: bf16, bias: 0},
		{name: "fp8_R2_column_major_scales", R: 2, T: 37, E: 8, K: 4, hidden: 256, dtype: dlpack.FP8E4M3, scales: 2,
			colScales: true, scalePad: 3, cfg: cfg(4, 2, 8), align: 1, combineDT: bf16},
		// 160 scales a row: a lane loads four before the row's copy, the 32 beyond them after it.
		{name: "fp8_R2_160_scales", R: 2, T: 12, E: 8, K: 4, hidden: 160 * 128, dtype: dlpack.FP8E4M3, scales: 160,
			colScales: true, cfg: cfg(4, 2, 8), align: 1, combineDT: bf16},
		{name: "odd_hidden_R2", R: 2, T: 45, E: 4, K: 3, hidden: 99, dtype: bf16, cfg: cfg(4, 3, 10), align: 1, bias: 1},
		{name: "f32_R2", R: 2, T: 30, E: 6, K: 4, hidden: 64, dtype: dlpack.F32, cfg: cfg(2, 2, 5), align: 1, bias: 2},
		{name: "bf16_R3_silent", R: 3, T: 50, E: 9, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1, silent: 2},
		// Any shape builds at its first launch: rows of 7168 bytes and an odd top-k, which no
		// kernel built ahead of time had.
		{name: "bf16_R2_hidden_3584_top5", R: 2, T: 24, E: 10, K: 5, hidden: 3584, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			envs := newDomain(t, c.R, 8<<20)
			runCase(t, envs, c)
			// The buffer works again for a second round (counters reset, barriers numbered on).
			runCase(t, envs, c)
		})
	}
}

// With blocks of 8 warps at 2 ranks, both halves of a channel send FP8 rows with 2 warps a half,
// so the halves take alternate sub-rings (kernels/intranode_dispatch.cuh's sub_ring): 4 of them on
// a big ring, 3 on a ring of 3 slots (where half 1 has one).
func TestEmulatedAlternateSubRings(t *testing.T) {
	opts := emu.Options()
	opts.Threads = 256
	for _, ring := range []int{256, 3} {
		c := rcase{name: fmt.Sprintf("fp8_R2_ring%d", ring), R: 2, T: 45, E: 8, K: 4, hidden: 512, dtype: dlpack.FP8E4M3, scales: 4,
			colScales: true, cfg: cfg(2, 2, ring), align: 1, combineDT: bf16}
		t.Run(c.name, func(t *testing.T) {
			envs := newDomainWith(t, c.R, 8<<20, opts)
			runCase(t, envs, c)
		})
	}
}

// TestEmulatedUseFabric: the kernels over use_fabric buffers, cuMem memory that each rank
// maps at its own address, shared through file descriptors or fabric handles.
func TestEmulatedUseFabric(t *testing.T) {
	c := rcase{name: "bf16_R3", R: 3, T: 50, E: 9, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}
	for _, mode := range []string{"fd", "fabric"} {
		t.Run(mode, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, mode)
			envs := newDomainOf(t, c.R, 8<<20, emu.Options(), true)
			runCase(t, envs, c)
		})
	}
}

// notifyOps makes every rank's inputs of c and its layout, and returns notify arguments.
func notifyOps(t *testing.T, envs []*rankEnv, c rcase) []*goep.NotifyOp {
	R, K, E, C := c.R, c.K, c.E, c.cfg.NumChannels()
	ops := make([]*goep.NotifyOp, R)
	for r, e := range envs {
		topk, _, _, _ := c.inputs(r)
		T := int64(c.tokens(r))
		dTopk := e.upload(t, dlpack.I64, bytesOf(topk), T, int64(K))
		op := &goep.NotifyOp{Config: c.cfg, NumTokens: int(T), NumExperts: E, ExpertAlignment: 1, TopkIdx: dTopk.t,
			PerRank: e.alloc(t, dlpack.I32, int64(R)).t, PerExpert: e.alloc(t, dlpack.I32, int64(E)).t,
			InRank: e.alloc(t, dlpack.BoolT, T, int64(R)).t, RankPrefix: e.alloc(t, dlpack.I32, int64(R), int64(R)).t,
			ChannelPrefix: e.alloc(t, dlpack.I32, int64(R), int64(C)).t, RecvChannelPrefix: e.alloc(t, dlpack.I32, int64(R), int64(C)).t,
			RecvPerExpert: e.alloc(t, dlpack.I32, int64(E/R)).t}
		require.NoError(t, e.normal().Layout(&goep.LayoutOp{NumExperts: E, NumRanks: R, TopkIdx: dTopk.t, PerRank: op.PerRank,
			PerExpert: op.PerExpert, InRank: op.InRank}))
		ops[r] = op
	}
	return ops
}

func notifyAll(envs []*rankEnv, ops []*goep.NotifyOp, only ...int) []error {
	return each(len(envs), func(r int) error {
		if len(only) > 0 && only[0] != r {
			return nil
		}
		peers, err := envs[r].buf.Peers()
		if err != nil {
			return err
		}
		_, err = envs[r].normal().Notify(peers, ops[r])
		return err
	})
}

func TestEmulatedErrors(t *testing.T) {
	c := rcase{R: 2, T: 40, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}
	envs := newDomain(t, c.R, 8<<20)

	// An expert index out of range on rank 1: rank 1 says which, rank 0 names rank 1.
	ops := notifyOps(t, envs, c)
	bad := unsafe.Slice((*int64)(ops[1].TopkIdx.Data), c.T*c.K)
	bad[3*c.K+2] = 13
	errs := notifyAll(envs, ops)
	require.Error(t, errs[1])
	assert.True(t, goep.IsArgument(errs[1]))
	assert.Contains(t, errs[1].Error(), "topk_idx[3,2] = 13 is out of range [0, 8)")
	require.Error(t, errs[0])
	assert.False(t, goep.IsArgument(errs[0]))
	assert.Contains(t, errs[0].Error(), "rank 1 has invalid arguments")
	assert.Contains(t, errs[0].Error(), "topk_idx[3,2] = 13")

	// The buffer still works.
	runCase(t, envs, c)

	// A bad index given to the layout (which does not wait for the GPU) fails the next notify,
	// here one without topk_idx, on every rank; a later layout's record replaces it.
	ops = notifyOps(t, envs, c)
	lbad := envs[0].upload(t, dlpack.I64, bytesOf([]int64{0, 1, 2, 3, 4, 5, 6, -1, -1, 99, 0, 1}), 3, 4)
	require.NoError(t, envs[0].normal().Layout(&goep.LayoutOp{NumExperts: c.E, NumRanks: c.R, TopkIdx: lbad.t,
		PerRank: envs[0].alloc(t, dlpack.I32, int64(c.R)).t, PerExpert: envs[0].alloc(t, dlpack.I32, int64(c.E)).t,
		InRank: envs[0].alloc(t, dlpack.BoolT, 3, int64(c.R)).t}))
	for _, op := range ops {
		op.TopkIdx = dlpack.Tensor{}
	}
	errs = notifyAll(envs, ops)
	require.Error(t, errs[0])
	assert.True(t, goep.IsArgument(errs[0]))
	assert.Contains(t, errs[0].Error(), "in its last get_dispatch_layout, topk_idx[2,1] = 99 is out of range [0, 8)")
	require.Error(t, errs[1])
	assert.Contains(t, errs[1].Error(), "rank 0 has invalid arguments")
	runCase(t, envs, c)

	// Bad indices in three of a layout's five blocks (the emulator's are 64 threads), one block at
	// a time too: each block records its first unless an earlier one is recorded, so the record
	// is the first in topk_idx's order whichever block comes last.
	for _, resident := range []string{"", "1"} {
		t.Setenv("PYEP_EMU_RESIDENT_BLOCKS", resident)
		idx := make([]int64, 300*c.K)
		for i := range idx {
			idx[i] = int64(i % c.E)
		}
		idx[250*c.K+1], idx[130*c.K+3], idx[200*c.K] = 77, -5, 8
		ops = notifyOps(t, envs, c)
		many := envs[0].upload(t, dlpack.I64, bytesOf(idx), 300, int64(c.K))
		require.NoError(t, envs[0].normal().Layout(&goep.LayoutOp{NumExperts: c.E, NumRanks: c.R, TopkIdx: many.t,
			PerRank: envs[0].alloc(t, dlpack.I32, int64(c.R)).t, PerExpert: envs[0].alloc(t, dlpack.I32, int64(c.E)).t,
			InRank: envs[0].alloc(t, dlpack.BoolT, 300, int64(c.R)).t}))
		t.Setenv("PYEP_EMU_RESIDENT_BLOCKS", "") // the dispatch's blocks run at once
		for _, op := range ops {
			op.TopkIdx = dlpack.Tensor{}
		}
		errs = notifyAll(envs, ops)
		require.Error(t, errs[0], "resident %q", resident)
		assert.Contains(t, errs[0].Error(), "in its last get_dispatch_layout, topk_idx[130,3] = -5 is out of range [0, 8)")
		runCase(t, envs, c)
	}

	// num_worst_tokens too small: the same error everywhere.
	ops = notifyOps(t, envs, c)
	for _, op := range ops {
		op.NumWorstTokens = 1
	}
	for r, err := range notifyAll(envs, ops) {
		require.Error(t, err, "rank %d", r)
		assert.True(t, goep.IsArgument(err))
		assert.Contains(t, err.Error(), "num_worst_tokens = 1 is too small: rank")
	}
	runCase(t, envs, c)

	// A buffer too small for the rings says so before anything moves.
	small := newDomain(t, c.R, 4096)
	sops := notifyOps(t, small, c)
	noErrors(t, notifyAll(small, sops))
	for r, err := range each(c.R, func(r int) error {
		peers, _ := small[r].buf.Peers()
		return small[r].normal().Dispatch(peers, &goep.DispatchOp{Config: c.cfg, HiddenBytes: 512})
	}) {
		require.Error(t, err, "rank %d", r)
		assert.True(t, goep.IsArgument(err))
		assert.Contains(t, err.Error(), "num_nvl_bytes = 4096 is too small")
	}

	// Rank 1 never calls: rank 0's notify times out naming it; then rank 1's call and every
	// later one fail at once.
	goep.SetOpTimeout(300 * time.Millisecond)
	defer goep.SetOpTimeout(20 * time.Second)
	ops = notifyOps(t, envs, c)
	start := time.Now()
	errs = notifyAll(envs, ops, 0)
	require.Error(t, errs[0])
	t.Log(errs[0])
	assert.Contains(t, errs[0].Error(), "timed out after")
	assert.Contains(t, errs[0].Error(), "waiting for rank 1 to join the call")
	assert.Less(t, time.Since(start), 5*time.Second)
	errs = notifyAll(envs, ops, 1)
	require.Error(t, errs[1])
	t.Log(errs[1])
	assert.Contains(t, errs[1].Error(), "stopped because rank 0 timed out waiting for rank 1")
	errs = notifyAll(envs, ops, 0)
	require.Error(t, errs[0])
	assert.Contains(t, errs[0].Error(), "failed earlier")
}

// TestEmulatedInRankMismatch: a cached dispatch whose is_token_in_rank routes another count of a
// channel's tokens than its channel_prefix_matrix says (the caller changed it after the dispatch)
// fails, and the next call of each rank says why: the rank at fault names the destination, the
// rank itself (whose own tokens skip the rings) or its peer.
func TestEmulatedInRankMismatch(t *testing.T) {
	c := rcase{R: 2, T: 40, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1}
	for _, dst := range []int{0, 1} {
		t.Run(fmt.Sprintf("to_rank_%d", dst), func(t *testing.T) {
			envs := newDomain(t, c.R, 8<<20)
			rounds := runCase(t, envs, c)
			rounds.inRank[0].b[dst] ^= 1        // token 0 of rank 0, to dst
			noErrors(t, rounds.cached(1, 0, 1)) // queued: the failure is the next call's
			errs := rounds.cached(2, 0, 1)
			require.Error(t, errs[0])
			t.Log(errs[0])
			assert.Contains(t, errs[0].Error(), fmt.Sprintf(
				"dispatch: rank 0 channel 0: is_token_in_rank routes other tokens to rank %d than channel_prefix_matrix says", dst))
			require.Error(t, errs[1])
			t.Log(errs[1])
			assert.Contains(t, errs[1].Error(), "stopped because rank 0 found")
		})
	}
}

// Four ranks at a GPU run's shape: DeepEP's config of 20 SMs, hidden 2880.
func TestEmulatedFourRanks(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of threads")
	}
	c := rcase{name: "hidden_2880_R4", R: 4, T: 48, E: 16, K: 8, hidden: 2880, dtype: bf16, cfg: cfg(20, 6, 256), align: 1, bias: 2}
	envs := newDomainWith(t, c.R, 96<<20, emu.Options4())
	runCase(t, envs, c)
}

// Two and four ranks in the GPU's shapes (up to 32 warps a block), one channel: slow. The rings
// of 3 and 5 slots have fewer slots than a peer has sending warps (as many sub-rings of one as
// slots; with both halves sending, the sub-rings they take alternate).
func TestEmulatedGPUBlocks(t *testing.T) {
	if os.Getenv("PYEP_EMU_SLOW") == "" {
		t.Skip("set PYEP_EMU_SLOW=1: thousands of threads")
	}
	sms := 2
	if v, err := strconv.Atoi(os.Getenv("PYEP_EMU_SMS")); err == nil {
		sms = v
	}
	// Each op in its GPU shape: at 2 ranks the BF16 dispatch, the FP8 dispatch and the combine each
	// have a block size of their own (896, 768, 1024 threads), at 4 ranks 1024 (a cached dispatch 768)
	// and 512.
	var cases []rcase
	for _, ring := range []int{256, 3} {
		cases = append(cases, rcase{name: fmt.Sprintf("hidden_2880_R4_ring%d", ring), R: 4, T: 48, E: 16, K: 8, hidden: 2880,
			dtype: bf16, cfg: cfg(sms, 2, ring), align: 1, bias: 2})
	}
	cases = append(cases,
		rcase{name: "hidden_2880_R2_ring5", R: 2, T: 40, E: 8, K: 8, hidden: 2880, dtype: bf16, cfg: cfg(sms, 2, 5), align: 1, bias: 1},
		rcase{name: "fp8_R2_ring256", R: 2, T: 24, E: 8, K: 4, hidden: 56 * 128, dtype: dlpack.FP8E4M3, scales: 56,
			cfg: cfg(sms, 2, 256), align: 1, combineDT: bf16},
		// Both halves send FP8 rows, on alternate sub-rings: 5 of them, so the halves' sets differ.
		rcase{name: "fp8_R2_ring5", R: 2, T: 37, E: 8, K: 4, hidden: 4 * 128, dtype: dlpack.FP8E4M3, scales: 4,
			cfg: cfg(sms, 2, 5), align: 1, combineDT: bf16},
		rcase{name: "f32_R2_ring256", R: 2, T: 96, E: 8, K: 8, hidden: 256, dtype: dlpack.F32, cfg: cfg(sms, 2, 256), align: 1, bias: 2})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			envs := newDomainWith(t, c.R, 96<<20, emu.OptionsGPU())
			runCase(t, envs, c)
		})
	}
}
