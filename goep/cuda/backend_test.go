package cuda_test

import (
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
)

// links is a fake NVLinkProbe: every pair is connected except those listed, by bus ids.
type links struct {
	mu     sync.Mutex
	broken map[[2]string]string
	calls  int
}

func (l *links) NVLinkP2P(a, b string) (bool, string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls++
	for _, k := range [][2]string{{a, b}, {b, a}} {
		if s, ok := l.broken[k]; ok {
			return false, s, nil
		}
	}
	return true, "OK", nil
}

// bus is the fake driver's PCI bus id of device ordinal.
func bus(ordinal int) string { return fmt.Sprintf("0000:%02X:00.0", 0x18+0x10*ordinal) }

// rank is one fake process: its driver and its Backend on device ordinal == rank.
type rank struct {
	drv *fake.Driver
	be  *cuda.Backend
}

func newRanks(t *testing.T, n int, probe cuda.NVLinkProbe, timeout time.Duration) []rank {
	t.Helper()
	ordinals := make([]int, n)
	for r := range ordinals {
		ordinals[r] = r
	}
	return ranksOn(t, ordinals, probe, timeout)
}

// ranksOn is one fake process a rank, rank r on device ordinals[r] (several ranks may share one).
func ranksOn(t *testing.T, ordinals []int, probe cuda.NVLinkProbe, timeout time.Duration) []rank {
	t.Helper()
	w := fake.NewWorld()
	ranks := make([]rank, len(ordinals))
	for r, ordinal := range ordinals {
		d := fake.New(fake.Config{World: w, Devices: 8})
		be, err := cuda.NewBackend(d, ordinal, cuda.BackendOptions{Timeout: timeout, NVLink: probe, Process: fmt.Sprint("rank", r)})
		require.NoError(t, err)
		ranks[r] = rank{d, be}
	}
	return ranks
}

func closeRanks(t *testing.T, ranks []rank) {
	t.Helper()
	for r, rk := range ranks {
		require.NoError(t, rk.be.Close())
		assert.Zero(t, rk.drv.Live(), "rank %d leaks", r)
		assert.ErrorIs(t, rk.drv.DevicePrimaryCtxRelease(rk.be.Device()), driver.ErrorInvalidContext, "rank %d: the context was released", r)
	}
}

func mem(t *testing.T, d *fake.Driver, p unsafe.Pointer, n int) []byte {
	t.Helper()
	b, err := d.Bytes(cuda.PtrOf(p), n)
	require.NoError(t, err)
	return b
}

func TestBackendBasics(t *testing.T) {
	rk := newRanks(t, 1, &links{}, time.Second)
	be := rk[0].be
	assert.Equal(t, "cuda", be.Name())
	assert.Equal(t, 0, be.DeviceID())
	assert.Equal(t, bus(0), be.PCIBusID())
	assert.NotZero(t, be.CommStream().Raw())

	const size = 1 << 16
	l, err := be.Allocate(size, 3)
	require.NoError(t, err)
	ctrl, data := cuda.PtrOf(l.Control()), cuda.PtrOf(l.Data())
	assert.Equal(t, ctrl+goep.ControlBytes, data, "data follows control")
	start, err := rk[0].drv.PointerGetAttribute(driver.PointerAttrRangeStartAddr, ctrl)
	require.NoError(t, err)
	assert.EqualValues(t, cuda.HeaderBytes, uint64(ctrl)-start, "the backend's header precedes control")
	all := mem(t, rk[0].drv, l.Control(), goep.ControlBytes+size)
	assert.Equal(t, make([]byte, len(all)), all, "control and data are zeroed")
	assert.NotEmpty(t, l.Token())

	rdma, err := be.AllocateRDMA(4096)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 4096), mem(t, rk[0].drv, rdma.Data(), 4096))
	require.NoError(t, rdma.Close())
	require.NoError(t, rdma.Close(), "idempotent")

	_, err = be.Open(l.Token(), size)
	assert.ErrorContains(t, err, "made by this process")
	_, err = be.Open([]byte("garbage"), size)
	assert.ErrorContains(t, err, "not a token of pyep's cuda backend")
	require.NoError(t, l.Close())
	require.NoError(t, l.Close(), "idempotent")
	_, err = be.AllocateRDMA(0)
	assert.Error(t, err)
	closeRanks(t, rk)
	_, err = be.Allocate(size, 1)
	assert.ErrorContains(t, err, "closed")
}

// TestBackendMakesItsContextCurrent: whatever context the calling thread has, the backend's
// calls act in its own device's primary context.
func TestBackendMakesItsContextCurrent(t *testing.T) {
	rk := newRanks(t, 2, &links{}, time.Second)
	d := rk[1].drv
	dev0, err := d.DeviceGet(0)
	require.NoError(t, err)
	other, err := dev0.PrimaryContext()
	require.NoError(t, err)
	require.NoError(t, other.MakeCurrent())
	l, err := rk[1].be.Allocate(256, 1)
	require.NoError(t, err)
	ord, err := d.PointerGetAttribute(driver.PointerAttrDeviceOrdinal, cuda.PtrOf(l.Data()))
	require.NoError(t, err)
	assert.EqualValues(t, 1, ord, "allocated on the backend's device, not the current one")
	require.NoError(t, l.Close())
	require.NoError(t, other.Release())
	closeRanks(t, rk)
}

func TestBackendAllocateFailureLeaksNothing(t *testing.T) {
	rk := newRanks(t, 1, &links{}, time.Second)
	live := rk[0].drv.Live()
	for _, op := range []string{"MemAlloc", "MemsetD8Async", "MemcpyAsync", "IpcGetMemHandle"} {
		rk[0].drv.FailNext(op, driver.ErrorOutOfMemory)
		_, err := rk[0].be.Allocate(1024, 1)
		assert.ErrorIs(t, err, driver.ErrorOutOfMemory, op)
		assert.Equal(t, live, rk[0].drv.Live(), "failed %s leaks", op)
	}
	closeRanks(t, rk)
}

// domain allocates a region on every rank and runs CheckPeers on each, as Buffer.Sync will.
func domain(t *testing.T, ranks []rank, size int64) ([]goep.LocalRegion, [][]byte) {
	t.Helper()
	return domainWith(t, ranks, size, (*cuda.Backend).Allocate)
}

// domainWith is domain with the allocation call of choice (Allocate or AllocateFabric).
func domainWith(t *testing.T, ranks []rank, size int64,
	allocate func(*cuda.Backend, int64, int) (goep.LocalRegion, error)) ([]goep.LocalRegion, [][]byte) {
	t.Helper()
	locals := make([]goep.LocalRegion, len(ranks))
	tokens := make([][]byte, len(ranks))
	ids := make([]int, len(ranks))
	for r, rk := range ranks {
		l, err := allocate(rk.be, size, len(ranks)-1)
		require.NoError(t, err)
		locals[r], tokens[r], ids[r] = l, l.Token(), r
	}
	for r, rk := range ranks {
		require.NoError(t, rk.be.CheckPeers(r, ids, tokens))
	}
	return locals, tokens
}

func openAll(t *testing.T, ranks []rank, tokens [][]byte, size int64) [][]goep.Region {
	t.Helper()
	peers := make([][]goep.Region, len(ranks))
	for r, rk := range ranks {
		peers[r] = make([]goep.Region, len(ranks))
		for p := range ranks {
			if p != r {
				reg, err := rk.be.Open(tokens[p], size)
				require.NoError(t, err, "rank %d opens %d", r, p)
				peers[r][p] = reg
			}
		}
	}
	return peers
}

// crossWrite: rank r writes byte 10r+p at offset r of peer p's data through its mapping, and
// every p finds each peer's byte in its own region.
func crossWrite(t *testing.T, rk []rank, locals []goep.LocalRegion, peers [][]goep.Region, size int64) {
	t.Helper()
	for r := range rk {
		for p := range rk {
			if p != r {
				mem(t, rk[r].drv, peers[r][p].Data(), int(size))[r] = byte(10*r + p)
			}
		}
	}
	for p := range rk {
		got := mem(t, rk[p].drv, locals[p].Data(), len(rk))
		for r := range rk {
			if r != p {
				assert.Equal(t, byte(10*r+p), got[r], "rank %d's byte in rank %d's region", r, p)
			}
		}
	}
}

func TestBackendPeersShareMemoryAndDestroyCleanly(t *testing.T) {
	const n, size = 4, 1 << 12
	probe := &links{}
	rk := newRanks(t, n, probe, time.Second)
	locals, tokens := domain(t, rk, size)
	assert.Equal(t, n*n*(n-1)/2, probe.calls, "every rank probes every pair once")
	peers := openAll(t, rk, tokens, size)
	assert.Equal(t, n*n*(n-1)/2, probe.calls, "Open reuses CheckPeers' answers")

	crossWrite(t, rk, locals, peers, size)
	for r := range rk {
		for p := range rk {
			if p != r {
				mem(t, rk[r].drv, peers[r][p].Control(), 8)[0] = 1
			}
		}
	}
	// Destroy, as Buffer.Destroy does: peers first, then the own region; ranks in any order.
	for r := range rk {
		for p := range rk {
			if p != r {
				require.NoError(t, peers[r][p].Close())
				require.NoError(t, peers[r][p].Close(), "idempotent")
			}
		}
	}
	for r := range rk {
		require.NoError(t, locals[r].Close())
		assert.Zero(t, rk[r].be.Deferred())
	}
	closeRanks(t, rk)
}

func TestBackendRanksSharingAGPU(t *testing.T) {
	const size = 1 << 12
	for _, tc := range []struct {
		name     string
		ordinals []int
		probes   int // NVLink probes of one rank: one per pair of distinct GPUs (answers are cached)
	}{
		{"4 ranks on one GPU", []int{0, 0, 0, 0}, 0},
		{"2 GPUs x 2 ranks", []int{0, 0, 1, 1}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A probe that refuses every pair: ranks on one GPU must not need it.
			broken := map[[2]string]string{{bus(0), bus(0)}: "NOT_SUPPORTED"}
			probe := &links{broken: broken}
			rk := ranksOn(t, tc.ordinals, probe, time.Second)
			locals, tokens := domain(t, rk, size)
			assert.Equal(t, len(rk)*tc.probes, probe.calls, "only pairs of distinct GPUs are probed")
			peers := openAll(t, rk, tokens, size)
			crossWrite(t, rk, locals, peers, size)
			for r := range rk {
				for p := range rk {
					if p != r {
						require.NoError(t, peers[r][p].Close())
					}
				}
			}
			for r := range rk {
				require.NoError(t, locals[r].Close())
			}
			closeRanks(t, rk)
		})
	}
}

func TestBackendDestroyWaitsForPeersBounded(t *testing.T) {
	const n, size = 3, 1 << 10
	rk := newRanks(t, n, &links{}, 100*time.Millisecond)
	locals, tokens := domain(t, rk, size)
	peers := openAll(t, rk, tokens, size)

	// Rank 0 destroys while ranks 1 and 2 still map its buffer: bounded wait, a named error,
	// the free deferred.
	for p := 1; p < n; p++ {
		require.NoError(t, peers[0][p].Close())
	}
	start := time.Now()
	err := locals[0].Close()
	require.Error(t, err)
	assert.Less(t, time.Since(start), 2*time.Second)
	assert.Contains(t, err.Error(), "ranks 1, 2 still map this rank's buffer after 100ms")
	assert.Equal(t, 1, rk[0].be.Deferred())
	require.NoError(t, locals[0].Close(), "closing again is a no-op")

	// Rank 1 releases; rank 2 does not yet: a sweep keeps the memory.
	require.NoError(t, peers[1][0].Close())
	l, err := rk[0].be.Allocate(size, 1) // sweeps
	require.NoError(t, err)
	assert.Equal(t, 1, rk[0].be.Deferred())
	require.NoError(t, l.Close())
	assert.Equal(t, 1, rk[0].be.Deferred())

	// Rank 2 releases: a sweep frees it (once the device is idle, which a sweep checks for 1 ms
	// only: under load one sweep can miss it).
	require.NoError(t, peers[2][0].Close())
	assert.Eventually(t, func() bool {
		l, err := rk[0].be.Allocate(size, 1)
		if !assert.NoError(t, err) {
			return true
		}
		assert.NoError(t, l.Close())
		return rk[0].be.Deferred() == 0
	}, 5*time.Second, 10*time.Millisecond, "the released buffer is freed by a sweep")

	for r := 1; r < n; r++ {
		for p := range rk {
			if p != r && p != 0 {
				require.NoError(t, peers[r][p].Close())
			}
		}
	}
	require.NoError(t, locals[1].Close())
	require.NoError(t, locals[2].Close())
	closeRanks(t, rk)
}

func TestBackendCloseReportsPeersThatNeverReleased(t *testing.T) {
	rk := newRanks(t, 2, &links{}, 50*time.Millisecond)
	locals, tokens := domain(t, rk, 512)
	peers := openAll(t, rk, tokens, 512)
	require.NoError(t, peers[0][1].Close())
	assert.ErrorContains(t, locals[0].Close(), "rank 1 still maps")
	err := rk[0].be.Close()
	assert.ErrorContains(t, err, "rank 1 still maps a buffer of this rank: its memory is kept until this process exits")
	assert.Equal(t, 1, rk[0].be.Deferred())
	require.NoError(t, peers[1][0].Close())
	require.NoError(t, locals[1].Close())
	require.NoError(t, rk[1].be.Close())
}

// TestBackendReopenAfterFailedSync: a sync that fails after opening some peers closes them
// (released) and may be retried; the retry's mapping is waited for again.
func TestBackendReopenAfterFailedSync(t *testing.T) {
	rk := newRanks(t, 2, &links{}, 50*time.Millisecond)
	locals, tokens := domain(t, rk, 512)
	r, err := rk[1].be.Open(tokens[0], 512)
	require.NoError(t, err)
	require.NoError(t, r.Close())
	require.NoError(t, rk[1].be.CheckPeers(1, []int{0, 1}, tokens))
	r, err = rk[1].be.Open(tokens[0], 512)
	require.NoError(t, err)
	assert.ErrorContains(t, locals[0].Close(), "rank 1 still maps")
	require.NoError(t, r.Close())
	require.NoError(t, locals[1].Close())
	closeRanks(t, rk)
}

func TestBackendWithoutCheckPeersFreesAtOnce(t *testing.T) {
	rk := newRanks(t, 2, &links{}, time.Hour)
	a, err := rk[0].be.Allocate(512, 1)
	require.NoError(t, err)
	r, err := rk[1].be.Open(a.Token(), 512)
	require.NoError(t, err)
	require.NoError(t, a.Close(), "no handshake without CheckPeers: no wait")
	require.NoError(t, r.Close())
	closeRanks(t, rk)
}

func TestBackendNVLinkCheck(t *testing.T) {
	probe := &links{broken: map[[2]string]string{{bus(1), bus(3)}: "NOT_SUPPORTED"}}
	rk := newRanks(t, 4, probe, time.Second)
	tokens := make([][]byte, 4)
	var locals []goep.LocalRegion
	for r := range rk {
		l, err := rk[r].be.Allocate(256, 3)
		require.NoError(t, err)
		locals = append(locals, l)
		tokens[r] = l.Token()
	}
	ranks := []int{8, 9, 10, 11} // the second NVLink domain of a group
	want := "rank 9 (GPU " + bus(1) + ") and rank 11 (GPU " + bus(3) + ") are not connected by NVLink (P2P status: NOT_SUPPORTED); " +
		"pyep's cuda backend needs NVLink between every pair of GPUs in a node — the cpu backend (gloo group) remains"
	for r := range rk {
		assert.EqualError(t, rk[r].be.CheckPeers(r, ranks, tokens), want, "every rank fails alike")
	}
	// Without CheckPeers, Open checks its own pair.
	_, err := rk[1].be.Open(tokens[3], 256)
	assert.EqualError(t, err, "this rank (GPU "+bus(1)+") and the peer (GPU "+bus(3)+") are not connected by NVLink (P2P status: NOT_SUPPORTED); "+
		"pyep's cuda backend needs NVLink between every pair of GPUs in a node — the cpu backend (gloo group) remains")
	r, err := rk[1].be.Open(tokens[2], 256)
	require.NoError(t, err)
	require.NoError(t, r.Close())

	// Another process's backend does not own tokens[0].
	rk0 := newRanks(t, 1, probe, time.Second)
	assert.ErrorContains(t, rk0[0].be.CheckPeers(0, ranks, tokens), "not a live buffer of this backend")

	assert.ErrorContains(t, rk[0].be.CheckPeers(0, []int{0}, tokens), "1 ranks for 4 tokens")
	assert.ErrorContains(t, rk[0].be.CheckPeers(4, ranks, tokens), "NVLink rank 4 of 4")
	bad := append([][]byte(nil), tokens...)
	bad[2] = []byte("junk")
	assert.ErrorContains(t, rk[0].be.CheckPeers(0, ranks, bad), "rank 10's buffer: not a token")
	same := append([][]byte(nil), tokens...)
	same[2] = tokens[0]
	assert.EqualError(t, rk[0].be.CheckPeers(0, ranks, same), "rank 8 and rank 10 gave the same buffer handle: every rank must make its own Buffer")
	for _, l := range locals {
		require.NoError(t, l.Close())
	}
	closeRanks(t, rk)
	closeRanks(t, rk0)
}

func TestBackendNVLinkProbeErrorAndMorePairs(t *testing.T) {
	probe := &links{broken: map[[2]string]string{{bus(0), bus(1)}: "NOT_SUPPORTED", {bus(0), bus(2)}: "NOT_SUPPORTED", {bus(1), bus(2)}: "NOT_SUPPORTED"}}
	rk := newRanks(t, 3, probe, time.Second)
	tokens := make([][]byte, 3)
	for r := range rk {
		l, err := rk[r].be.Allocate(256, 2)
		require.NoError(t, err)
		defer func() { require.NoError(t, l.Close()) }()
		tokens[r] = l.Token()
	}
	err := rk[2].be.CheckPeers(2, []int{0, 1, 2}, tokens)
	assert.ErrorContains(t, err, "rank 0 (GPU "+bus(0)+") and rank 1 (GPU "+bus(1)+") are not connected by NVLink (P2P status: NOT_SUPPORTED) (and 2 more pairs); ")
}

func TestBackendOpenChecks(t *testing.T) {
	rk := newRanks(t, 2, &links{}, time.Second)
	l, err := rk[0].be.Allocate(512, 1)
	require.NoError(t, err)
	live := rk[1].drv.Live()

	_, err = rk[1].be.Open(l.Token(), 1024)
	assert.ErrorContains(t, err, "the peer's buffer has 512 bytes: expected 1024")

	// A token whose nonce is not the region's: the memory is not the buffer the token names.
	tok := l.Token()
	binary.LittleEndian.PutUint64(tok[8:], binary.LittleEndian.Uint64(tok[8:])+1)
	_, err = rk[1].be.Open(tok, 512)
	assert.ErrorContains(t, err, "no longer exists")
	assert.Equal(t, live, rk[1].drv.Live(), "the mapping was closed again")

	// The token of a destroyed buffer.
	stale := l.Token()
	require.NoError(t, l.Close())
	_, err = rk[1].be.Open(stale, 512)
	assert.ErrorIs(t, err, driver.ErrorInvalidValue)
	assert.Equal(t, live, rk[1].drv.Live())
	closeRanks(t, rk)
}

func TestStreamWait(t *testing.T) {
	rk := newRanks(t, 1, &links{}, time.Second)
	d, be := rk[0].drv, rk[0].be
	torch := be.WrapStream(0) // the legacy default stream, as PyTorch's current stream may be
	comm := be.CommStream()
	records, waits := d.Calls("EventRecord"), d.Calls("StreamWaitEvent")
	require.NoError(t, be.StreamWait(comm, torch))
	require.NoError(t, be.StreamWait(torch, comm))
	require.NoError(t, be.StreamWait(comm, comm))
	assert.Equal(t, records+2, d.Calls("EventRecord"))
	assert.Equal(t, waits+2, d.Calls("StreamWaitEvent"))
	assert.Error(t, be.StreamWait(be.WrapStream(0xdead), comm), "an unknown stream")
	closeRanks(t, rk)
}

// TestBufferOverCudaBackend runs goep.Buffer's lifecycle over fake GPUs, calling CheckPeers
// the way Buffer.Sync is to call it.
func TestBufferOverCudaBackend(t *testing.T) {
	const n, size = 2, 1 << 12
	rk := newRanks(t, n, &links{}, 200*time.Millisecond)
	bufs := make([]*goep.Buffer, n)
	handles := make([][]byte, n)
	tokens := make([][]byte, n)
	for r := range rk {
		b, err := goep.NewBuffer(goep.Params{Rank: r, NumRanks: n, NumNVLBytes: size}, rk[r].be)
		require.NoError(t, err)
		bufs[r] = b
		handles[r], err = b.LocalIPCHandle()
		require.NoError(t, err)
		h, err := goep.DecodeHandle(handles[r])
		require.NoError(t, err)
		assert.Equal(t, "cuda", h.Backend)
		tokens[r] = h.Token
	}
	for r := range rk {
		require.NoError(t, rk[r].be.CheckPeers(r, []int{0, 1}, tokens))
		require.NoError(t, bufs[r].Sync([]int{0, 1}, handles, nil))
		assert.Equal(t, r, bufs[r].LocalDeviceID())
	}
	for r := range rk {
		p, sz, err := bufs[r].PeerData(1-r, false)
		require.NoError(t, err)
		assert.EqualValues(t, size, sz)
		mem(t, rk[r].drv, p, size)[0] = byte(r + 1)
	}
	for r := range rk {
		p, _, err := bufs[r].LocalData(false)
		require.NoError(t, err)
		assert.Equal(t, byte(2-r), mem(t, rk[r].drv, p, 1)[0])
	}
	// Rank 0 alone destroys: rank 1 still maps its buffer.
	err := bufs[0].Destroy()
	require.Error(t, err)
	assert.True(t, strings.HasPrefix(err.Error(), "destroy rank 0: pyep: cuda: rank 1 still maps this rank's buffer"), err.Error())
	require.NoError(t, bufs[1].Destroy())
	closeRanks(t, rk) // the deferred free happens here, rank 1 having released
}

// TestNVMLProbeErrors: without libnvidia-ml the probe says NVML is needed; with it, bogus bus
// ids are refused. Either way an error, never a crash.
func TestNVMLProbeErrors(t *testing.T) {
	_, _, err := cuda.NVML().NVLinkP2P("0000:ff:1f.7", "0000:fe:1f.7")
	require.Error(t, err)
	assert.Contains(t, strings.ToLower(err.Error()), "nvml", "without NVML it names NVML; with it, the NVML call that refused")
	t.Log(err)
}

// The optional method goep.Buffer.Sync calls before opening peers: its exact signature.
var _ interface {
	CheckPeers(nvlRank int, ranks []int, tokens [][]byte) error
} = (*cuda.Backend)(nil)
