//go:build cgo

package emu_test

import (
	"fmt"
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
	"github.com/pyep/pyep/goep/cuda/emu"
)

// The cuda backend runs no mode itself: a goep.Buffer on it runs each mode through the engine
// that Params.Engines makes (goep/cuda/normal, goep/cuda/lowlatency, composed as goep/api does),
// and without one the mode is not available (the host never runs goep/lowlatency over device
// memory).
func TestBufferEngines(t *testing.T) {
	const R = 2
	size, err := goep.LowLatencySizeHint(8, 256, R, 8)
	require.NoError(t, err)
	for _, withEngines := range []bool{true, false} {
		t.Run(fmt.Sprintf("engines=%v", withEngines), func(t *testing.T) {
			p := goep.Params{NumRanks: R, NumNVLBytes: 1 << 20, NumRDMABytes: size, LowLatencyMode: true, EnableShrink: true}
			if withEngines {
				p.Engines = engines
			}
			bufs := syncedBuffers(t, p)
			_, err := bufs[0].NormalEngine()
			masks := make([]int32, R)
			query := func() error {
				return bufs[0].LowLatencyMask("low_latency_query_mask_buffer", 0, false, uintptr(unsafe.Pointer(&masks[0])))
			}
			if !withEngines {
				assert.EqualError(t, err, "normal mode is not available on the cuda backend")
				assert.EqualError(t, query(), "low_latency_query_mask_buffer: low-latency mode is not available on the cuda backend with 2 ranks")
				return
			}
			require.NoError(t, err)
			// A zero-copy combine sends bf16 rows: with use_logfmt it is refused before anything is queued.
			_, err = bufs[0].LowLatencyCombine(&goep.LLCombineArgs{MaxTokens: 8, Hidden: 256, NumExperts: 8, NumTopk: 1,
				ZeroCopy: true, LogFMT: true})
			assert.EqualError(t, err, "low_latency_combine: zero_copy=True and use_logfmt=True: a zero-copy combine sends bf16 "+
				"rows (expected at most one of them)")
			// The mask is the device engine's word in rank 0's region.
			require.NoError(t, bufs[0].LowLatencyMask("low_latency_update_mask_buffer", 1, true, 0))
			require.NoError(t, query())
			assert.Equal(t, []int32{0, 1}, masks)
		})
	}
}

// Across nodes (PYEP_RANKS_PER_NODE) the cuda backend's low-latency mode runs over NVSHMEM, which
// a backend over the fake driver does not bootstrap: the buffer syncs, and every call says why
// it cannot run, before anything is queued.
func TestLowLatencyAcrossNodesIsNotAvailable(t *testing.T) {
	const R = 2
	size, err := goep.LowLatencySizeHint(8, 256, R, 8)
	require.NoError(t, err)
	bufs := syncedBuffers(t, goep.Params{NumRanks: R, NumNVLBytes: 1 << 20, NumRDMABytes: size, LowLatencyMode: true,
		EnableShrink: true, RanksPerNode: 1, Engines: engines})
	_, err = bufs[0].LowLatencyNextCombineBuffer(8, 256, 8)
	require.Error(t, err)
	assert.True(t, goep.IsNotAvailable(err))
	assert.EqualError(t, err, "get_next_low_latency_combine_buffer: low-latency mode across nodes (2 ranks, 2 nodes of 1) "+
		"on the cuda backend needs NVSHMEM (NVSHMEM is not available: this cuda backend was made without it "+
		"(BackendOptions.NVSHMEM, which tests over the fake driver leave off)); the 2 ranks are 2 nodes because "+
		"PYEP_RANKS_PER_NODE = 1: unset it to run them as one node")
	_, err = bufs[1].LowLatencyDispatch(&goep.LLDispatchArgs{MaxTokens: 8, Hidden: 256, NumExperts: 8, NumTopk: 1})
	assert.True(t, goep.IsNotAvailable(err), "%v", err)
}

// syncedBuffers makes and syncs the buffers of p (its Rank set per rank) on fake GPUs.
func syncedBuffers(t *testing.T, p goep.Params) []*goep.Buffer {
	t.Helper()
	w := fake.NewWorld()
	bufs := make([]*goep.Buffer, p.NumRanks)
	handles := make([][]byte, p.NumRanks)
	ids := make([]int, p.NumRanks)
	bes := make([]*cuda.Backend, p.NumRanks)
	t.Cleanup(func() {
		// Every rank destroys at once: a buffer waits for its peers to release it.
		var wg sync.WaitGroup
		for _, b := range bufs {
			if b != nil {
				wg.Add(1)
				go func() { defer wg.Done(); assert.NoError(t, b.Destroy()) }()
			}
		}
		wg.Wait()
		for _, be := range bes {
			if be != nil {
				assert.NoError(t, be.Close())
			}
		}
	})
	for r := range bufs {
		d := fake.New(fake.Config{World: w, Devices: 8, MemBytes: 1 << 30, Guard: os.Getenv("PYEP_EMU_NOGUARD") == ""})
		be, err := cuda.NewBackend(d, r, cuda.BackendOptions{Timeout: 20 * time.Second, NVLink: allLinks{}, Process: fmt.Sprint("rank", r)})
		require.NoError(t, err)
		be.SetNormalOptions(emu.Options())
		bes[r] = be
		p.Rank = r
		bufs[r], err = goep.NewBuffer(p, be)
		require.NoError(t, err)
		handles[r], err = bufs[r].LocalIPCHandle()
		require.NoError(t, err)
		ids[r] = r
	}
	root, err := bufs[0].LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	for _, b := range bufs {
		require.NoError(t, b.Sync(ids, handles, root))
	}
	return bufs
}
