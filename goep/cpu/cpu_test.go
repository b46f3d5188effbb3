package cpu_test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cpu"
	"github.com/pyep/pyep/goep/shm"
)

const nvlBytes = 1 << 16

// group makes numRanks buffers in this process, standing in for the ranks' processes: the
// shared segments behave the same within one process.
func group(t *testing.T, numRanks int) []*goep.Buffer {
	t.Helper()
	buffers := make([]*goep.Buffer, numRanks)
	handles := make([][]byte, numRanks)
	for r := range buffers {
		b, err := goep.NewBuffer(goep.Params{Rank: r, NumRanks: numRanks, NumNVLBytes: nvlBytes}, cpu.Backend{})
		require.NoError(t, err)
		buffers[r] = b
		handles[r], err = b.LocalIPCHandle()
		require.NoError(t, err)
		t.Cleanup(func() { _ = b.Destroy() })
	}
	devices := make([]int, numRanks)
	for _, b := range buffers {
		require.NoError(t, b.Sync(devices, handles, nil))
	}
	return buffers
}

func ownSegments(t *testing.T) []string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(shm.Dir, fmt.Sprintf("pyep-%d-*", os.Getpid())))
	require.NoError(t, err)
	return names
}

func TestPeersSeeWrites(t *testing.T) {
	for _, numRanks := range []int{1, 2, 4, 8} {
		buffers := group(t, numRanks)
		for r, b := range buffers {
			data, size, err := b.LocalData(false)
			require.NoError(t, err)
			require.EqualValues(t, nvlBytes, size)
			*(*int64)(unsafe.Add(data, 8*r)) = int64(100 + r)
		}
		for _, b := range buffers {
			for peer := 0; peer < numRanks; peer++ {
				data, _, err := b.PeerData(peer, false)
				require.NoError(t, err)
				assert.EqualValues(t, 100+peer, *(*int64)(unsafe.Add(data, 8*peer)))
			}
		}
		assert.Empty(t, ownSegments(t), "every segment's name is gone once all its peers mapped it")
		for _, b := range buffers {
			require.NoError(t, b.Destroy())
			require.NoError(t, b.Destroy(), "destroy is idempotent")
			assert.False(t, b.IsAvailable())
			_, _, err := b.LocalData(false)
			assert.ErrorContains(t, err, "destroyed")
		}
	}
}

func TestSyncMisuse(t *testing.T) {
	buffers := group(t, 2)
	err := buffers[0].Sync([]int{0, 0}, nil, nil)
	assert.ErrorContains(t, err, "already synced")

	a, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 2, NumNVLBytes: nvlBytes}, cpu.Backend{})
	require.NoError(t, err)
	defer a.Destroy()
	own, err := a.LocalIPCHandle()
	require.NoError(t, err)
	peer, err := buffers[1].LocalIPCHandle()
	require.NoError(t, err)
	_, _, err = a.PeerData(1, false)
	assert.ErrorContains(t, err, "not synced")

	tests := []struct {
		name    string
		devices []int
		handles [][]byte
		err     string
	}{
		{"devices", []int{0}, [][]byte{own, peer}, "device_ids has 1 entries"},
		{"count", []int{0, 0}, [][]byte{own}, "ipc_handles has 1 entries"},
		{"missing own", []int{0, 0}, [][]byte{nil, peer}, "ipc_handles[0] is missing"},
		{"missing peer", []int{0, 0}, [][]byte{own, nil}, "ipc_handles[1] is missing"},
		{"not own", []int{0, 0}, [][]byte{peer, peer}, "ipc_handles[0] is not this rank's own handle"},
		{"garbage", []int{0, 0}, [][]byte{own, []byte("garbage")}, "ipc_handles[1]: not a pyep buffer handle"},
		{"own in peer slot", []int{0, 0}, [][]byte{own, own}, "made by rank 0 of 2: expected rank 1 of 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := a.Sync(tt.devices, tt.handles, nil)
			assert.ErrorContains(t, err, tt.err)
			assert.True(t, goep.IsArgument(err))
			assert.False(t, a.IsAvailable())
		})
	}
	// A peer whose buffer was destroyed: its segment is gone.
	require.NoError(t, buffers[1].Destroy())
	err = a.Sync([]int{0, 0}, [][]byte{own, peer}, nil)
	assert.ErrorIs(t, err, shm.ErrGone)
	// Destroyed buffers refuse everything.
	require.NoError(t, a.Destroy())
	assert.ErrorContains(t, a.Sync([]int{0, 0}, [][]byte{own, peer}, nil), "destroyed")
	_, err = a.LocalIPCHandle()
	assert.ErrorContains(t, err, "destroyed")
}

func TestRDMAAndLowLatency(t *testing.T) {
	b, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 1, NumNVLBytes: nvlBytes, NumRDMABytes: 4096, LowLatencyMode: true}, cpu.Backend{})
	require.NoError(t, err)
	defer b.Destroy()
	own, err := b.LocalIPCHandle()
	require.NoError(t, err)
	assert.ErrorContains(t, b.Sync([]int{0}, [][]byte{own}, []byte("short")), "root_unique_id has 5 bytes")
	uid, err := b.LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	require.NoError(t, b.Sync([]int{0}, [][]byte{own}, uid))
	data, size, err := b.LocalData(true)
	require.NoError(t, err)
	assert.EqualValues(t, 4096, size)
	*(*byte)(unsafe.Add(data, 4095)) = 7

	_, err = goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 1, NumNVLBytes: nvlBytes, NumRDMABytes: 4096}, cpu.Backend{})
	assert.ErrorContains(t, err, "num_rdma_bytes = 4096: an RDMA buffer needs more than 8 ranks")

	_, err = goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 1, NumNVLBytes: nvlBytes, EnableShrink: true}, cpu.Backend{})
	assert.ErrorContains(t, err, "enable_shrink=True: shrink mode masks ranks in low-latency mode; expected low_latency_mode=True")
	assert.True(t, goep.IsArgument(err))
	shrink, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 1, NumRDMABytes: 4096, LowLatencyMode: true, EnableShrink: true}, cpu.Backend{})
	require.NoError(t, err)
	require.NoError(t, shrink.Destroy())
}

// PYEP_RANKS_PER_NODE=2 makes 4 ranks two nodes: the low-latency regions are still shared by
// every rank (one machine), and an RDMA buffer no longer needs low-latency mode.
func TestLowLatencyAcrossEmulatedNodes(t *testing.T) {
	const R = 4
	size, err := goep.LowLatencySizeHint(2, 128, R, R)
	require.NoError(t, err)
	buffers := make([]*goep.Buffer, R)
	handles := make([][]byte, R)
	for r := range buffers {
		b, err := goep.NewBuffer(goep.Params{Rank: r, NumRanks: R, NumRDMABytes: size, LowLatencyMode: true, RanksPerNode: 2}, cpu.Backend{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = b.Destroy() })
		buffers[r] = b
		handles[r], err = b.LocalIPCHandle()
		require.NoError(t, err)
		require.NotEmpty(t, handles[r], "the low-latency region's token travels in the handle")
	}
	uid := make([]byte, goep.UniqueIDBytes)
	for r, b := range buffers {
		require.NoError(t, b.Sync(make([]int, R), handles, uid))
		topo := b.Topology()
		assert.Equal(t, [4]int{r / 2, 2, r % 2, 2}, [4]int{topo.RDMARank, topo.NumRDMARanks, topo.NVLRank, topo.NumNVLRanks})
		_, err := b.LowLatencyNextCombineBuffer(2, 128, R)
		require.NoError(t, err, "rank %d has a low-latency engine", r)
	}
	rdma, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: R, NumRDMABytes: 4096, RanksPerNode: 2}, cpu.Backend{})
	require.NoError(t, err)
	require.NoError(t, rdma.Destroy())
	_, err = goep.NewBuffer(goep.Params{Rank: 0, NumRanks: R, NumRDMABytes: 4096, RanksPerNode: 4}, cpu.Backend{})
	assert.ErrorContains(t, err, "num_rdma_bytes = 4096: an RDMA buffer needs more than 4 ranks (more than one node)")
}

func TestSegmentsArePrivate(t *testing.T) {
	b, err := goep.NewBuffer(goep.Params{Rank: 0, NumRanks: 2, NumNVLBytes: nvlBytes}, cpu.Backend{})
	require.NoError(t, err)
	names := ownSegments(t)
	require.Len(t, names, 1)
	st, err := os.Stat(names[0])
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	require.NoError(t, b.Destroy())
	assert.Empty(t, ownSegments(t), "destroy removes a name no peer mapped")
}
