package goep

import (
	"errors"
	"fmt"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The whole Buffer lifecycle through the NVSHMEM path, over the stub backend
// (symmetric_stub_test.go): NewBuffer, the root's unique id, Sync with it, the engine made over
// the symmetric region, calls, Destroy; and the ways it fails.

const symRDMABytes = 1 << 20

// symGroup is the ranks of one group, each with its own backend (its process) over one world.
type symGroup struct {
	w        *symWorld
	m        *stubMaker
	bufs     []*Buffer
	backends []*symBackend
	handles  [][]byte
	devices  []int
	root     []byte
}

// newSymGroup makes a group of n ranks in nodes of perNode (0: DeepEP's), each buffer with nvl
// NVLink bytes and the low-latency region, and gathers what sync takes, as the Python layer
// does: every rank's handle and device, and rank 0's unique id.
func newSymGroup(t *testing.T, n, perNode int, nvl int64, noNVLink bool) *symGroup {
	t.Helper()
	w := newSymWorld()
	g := &symGroup{w: w, m: &stubMaker{w: w}, devices: make([]int, n)}
	for r := range n {
		be := &symBackend{w: w, rank: r}
		b, err := NewBuffer(Params{Rank: r, NumRanks: n, NumNVLBytes: nvl, NumRDMABytes: symRDMABytes, LowLatencyMode: true,
			NoNVLinkForLowLatency: noNVLink, RanksPerNode: perNode, Engines: Engines{LowLatency: g.m.maker}}, be)
		require.NoError(t, err)
		h, err := b.LocalIPCHandle()
		require.NoError(t, err)
		g.bufs, g.backends, g.handles = append(g.bufs, b), append(g.backends, be), append(g.handles, h)
	}
	root, err := g.bufs[0].LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	g.root = root
	return g
}

func (g *symGroup) sync(r int) error { return g.bufs[r].Sync(g.devices, g.handles, g.root) }

// engineOf is the engine made for rank r (the latest).
func (g *symGroup) engineOf(t *testing.T, r int) *stubEngine {
	t.Helper()
	for i := len(g.m.made) - 1; i >= 0; i-- {
		if e := g.m.made[i]; e.env.Topo.Rank == r {
			return e
		}
	}
	t.Fatalf("no engine made for rank %d", r)
	return nil
}

func heapPtr(w *symWorld, p int) unsafe.Pointer { return unsafe.Pointer(&w.heap[p][0]) }

// llCalls runs every low-latency entry point once on b; by name, what each returned.
func llCalls(b *Buffer) map[string]error {
	const M, H, E = 4, 128, 8
	errs := map[string]error{}
	_, errs["low_latency_dispatch"] = b.LowLatencyDispatch(&LLDispatchArgs{MaxTokens: M, Hidden: H, NumExperts: E, NumTokens: 1, NumTopk: 1})
	_, errs["low_latency_combine"] = b.LowLatencyCombine(&LLCombineArgs{MaxTokens: M, Hidden: H, NumExperts: E, NumTokens: 1, NumTopk: 1})
	errs["hook"] = b.LowLatencyReceive(1, 0)
	errs["clean_low_latency_buffer"] = b.LowLatencyClean(M, H, E)
	_, errs["get_next_low_latency_combine_buffer"] = b.LowLatencyNextCombineBuffer(M, H, E)
	errs["PYEP_TIMEOUT_S"] = b.SetLowLatencyTimeout(1e9)
	return errs
}

// Four ranks in two nodes of two: rank 0's unique id is NVSHMEM's, every rank joins the group
// from it as its own PE and gets its region in the heap; the engine writes its node's peer
// through NVSHMEM's mapping and the other node's through puts; Destroy closes the engine, then
// the region, then the NVLink buffer, once.
func TestNVSHMEMBufferLifecycle(t *testing.T) {
	g := newSymGroup(t, 4, 2, 1<<12, false)
	w := g.w
	assert.Equal(t, w.id, g.root, "the root hands out NVSHMEM's unique id")
	assert.Equal(t, 1, g.backends[0].ids)
	for r := range 4 {
		require.NoError(t, g.sync(r), "rank %d", r)
		assert.True(t, g.bufs[r].IsAvailable())
	}
	for r, be := range g.backends {
		assert.Equal(t, []symOpen{{Root: w.id, Rank: r, NumRanks: 4, NumBytes: symRDMABytes}}, be.opens, "rank %d", r)
		if r > 0 {
			assert.Zero(t, be.ids, "only the root asks for a unique id")
		}
	}
	require.Len(t, g.m.made, 4)

	// Rank 1: its own region, rank 0's as NVSHMEM maps it, ranks 2 and 3 by puts only.
	e := g.engineOf(t, 1)
	assert.Equal(t, []bool{false, false, true, true}, e.env.Remote)
	assert.Equal(t, []unsafe.Pointer{heapPtr(w, 0), heapPtr(w, 1), nil, nil}, e.regions)
	assert.Equal(t, g.backends[1].regions[0].Data(), e.regions[1])
	assert.Equal(t, []int{0}, g.backends[1].regions[0].peers, "nvshmem_ptr is asked for the node's peers only")
	assert.EqualValues(t, symRDMABytes, e.numBytes)
	assert.Equal(t, 1, e.env.Topo.Rank)
	assert.EqualValues(t, 1<<12, e.env.NumNVLBytes)
	assert.Equal(t, OpTimeout(), e.timeout)
	tokens := make([][]byte, 4)
	for r := range tokens {
		tokens[r] = []byte(fmt.Sprintf("nvl-token-%d", r))
	}
	assert.Equal(t, tokens, e.tokens, "every rank's NVLink-buffer token, from the handles")
	// Rank 2, of the other node: rank 3 mapped, 0 and 1 remote.
	e2 := g.engineOf(t, 2)
	assert.Equal(t, []bool{true, true, false, false}, e2.env.Remote)
	assert.Equal(t, []unsafe.Pointer{nil, nil, heapPtr(w, 2), heapPtr(w, 3)}, e2.regions)

	// The RDMA buffer is the region in the heap; the calls reach the engine.
	b := g.bufs[1]
	data, size, err := b.LocalData(true)
	require.NoError(t, err)
	assert.Equal(t, heapPtr(w, 1), data)
	assert.EqualValues(t, symRDMABytes, size)
	for name, err := range llCalls(b) {
		if name == "hook" {
			assert.ErrorContains(t, err, "has no receive waiting", name)
			continue
		}
		assert.NoError(t, err, name)
	}
	assert.Equal(t, []bool{false, true}, e.launches)
	assert.Equal(t, 1, e.cleans)
	assert.Equal(t, 1e9, float64(e.timeout))

	// Destroy: the NVLink peers, the engine, NVSHMEM's region, the NVLink buffer; nothing twice.
	before := len(w.events())
	require.NoError(t, b.Destroy())
	assert.Equal(t, []string{"close peer nvl-token-0 on 1", "close engine 1", "close symmetric 1", "close nvl 1"}, w.events()[before:])
	require.NoError(t, b.Destroy())
	assert.Len(t, w.events(), before+4)
	assert.Equal(t, 1, g.backends[1].regions[0].closes)
	assert.Equal(t, 1, e.closes)
	for name, err := range llCalls(b) {
		assert.ErrorIs(t, err, errDestroyed, name)
	}
	_, _, err = b.LocalData(true)
	assert.ErrorIs(t, err, errDestroyed)
	for _, be := range g.backends {
		assert.NotContains(t, w.events(), fmt.Sprintf("allocate rdma %d", be.rank), "no region outside the heap")
	}
}

// The root's unique id: NVSHMEM's only where the buffer runs NVSHMEM and the backend has it;
// random bytes of the same size otherwise, and NVSHMEM's failures other than its absence surface.
func TestNVSHMEMRootUniqueID(t *testing.T) {
	w := newSymWorld()
	newRoot := func(n, perNode int, noNVLink bool, be Backend) *Buffer {
		b, err := NewBuffer(Params{Rank: 0, NumRanks: n, NumRDMABytes: symRDMABytes, LowLatencyMode: true, RanksPerNode: perNode,
			NoNVLinkForLowLatency: noNVLink}, be)
		require.NoError(t, err)
		return b
	}
	be := &symBackend{w: w}
	id, err := newRoot(2, 1, false, be).LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	assert.Equal(t, w.id, id)
	id, err = newRoot(2, 0, true, be).LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	assert.Equal(t, w.id, id, "allow_nvlink_for_low_latency_mode=False on one node runs NVSHMEM too")
	assert.Equal(t, 2, be.ids)

	// One node: no NVSHMEM, so the backend is not asked (its id would start a bootstrap).
	id, err = newRoot(2, 0, false, be).LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	assert.Len(t, id, UniqueIDBytes)
	assert.NotEqual(t, w.id, id)
	assert.Equal(t, 2, be.ids)

	// No NVSHMEM here: random bytes, and sync says so again.
	be.idErr = NotAvailablef("NVSHMEM is not available: no libnvshmem_host.so")
	id, err = newRoot(2, 1, false, be).LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	assert.Len(t, id, UniqueIDBytes)
	assert.NotEqual(t, w.id, id)

	// Any other failure is the caller's to see.
	be.idErr = errors.New("pyep: nvshmem: nvshmemx_get_uniqueid: status 7")
	_, err = newRoot(2, 1, false, be).LocalNVSHMEMUniqueID()
	assert.EqualError(t, err, "pyep: nvshmem: nvshmemx_get_uniqueid: status 7")

	// A backend without NVSHMEM: random bytes.
	id, err = newRoot(2, 1, false, plainBackend{be}).LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	assert.Len(t, id, UniqueIDBytes)
	assert.Equal(t, 4, be.ids)
}

// plainBackend is the stub without SymmetricBackend: a device backend that has no NVSHMEM.
type plainBackend struct{ Backend }

// Without NVSHMEM the buffer syncs, makes no engine, and every low-latency call raises the
// NotAvailableError that names why, and PYEP_RANKS_PER_NODE where it made the nodes.
func TestNVSHMEMNotAvailable(t *testing.T) {
	why := "NVSHMEM is not available: libnvshmem_host.so.3: cannot open shared object file"
	for _, c := range []struct {
		name            string
		n, perNode, me  int
		plain, noNVLink bool
		want            string
	}{
		{name: "emulated nodes", n: 4, perNode: 2, me: 3,
			want: "%s: low-latency mode across nodes (4 ranks, 2 nodes of 2) on the stub backend needs NVSHMEM (" + why +
				"); the 4 ranks are 2 nodes because PYEP_RANKS_PER_NODE = 2: unset it to run them as one node"},
		{name: "DeepEP's nodes", n: 16, me: 9,
			want: "%s: low-latency mode across nodes (16 ranks, 2 nodes of 8) on the stub backend needs NVSHMEM (" + why + ")"},
		{name: "allow_nvlink=False on one node", n: 4, me: 1, noNVLink: true,
			want: "%s: low-latency mode with allow_nvlink_for_low_latency_mode=False (4 ranks on one node, every peer " +
				"through NVSHMEM) on the stub backend needs NVSHMEM (" + why + "); pass allow_nvlink_for_low_latency_mode=True " +
				"to run it on one node without NVSHMEM"},
		{name: "allow_nvlink=False on emulated nodes", n: 4, perNode: 2, me: 1, noNVLink: true,
			want: "%s: low-latency mode across nodes (4 ranks, 2 nodes of 2) with allow_nvlink_for_low_latency_mode=False on " +
				"the stub backend needs NVSHMEM (" + why + "); the 4 ranks are 2 nodes because PYEP_RANKS_PER_NODE = 2: unset " +
				"it to run them as one node, with allow_nvlink_for_low_latency_mode=True"},
		{name: "no NVSHMEM in the backend", n: 2, perNode: 1, me: 1, plain: true,
			want: "%s: low-latency mode across nodes (2 ranks, 2 nodes of 1) on the stub backend needs NVSHMEM (the stub " +
				"backend has no NVSHMEM); the 2 ranks are 2 nodes because PYEP_RANKS_PER_NODE = 1: unset it to run them as one node"},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := newSymWorld()
			m := &stubMaker{w: w}
			sb := &symBackend{w: w, rank: c.me, openErr: NotAvailablef("%s", why)}
			var be Backend = sb
			if c.plain {
				be = plainBackend{sb}
			}
			b, err := NewBuffer(Params{Rank: c.me, NumRanks: c.n, NumRDMABytes: symRDMABytes, LowLatencyMode: true,
				RanksPerNode: c.perNode, NoNVLinkForLowLatency: c.noNVLink, Engines: Engines{LowLatency: m.maker}}, be)
			require.NoError(t, err)
			require.NoError(t, b.Sync(make([]int, c.n), make([][]byte, c.n), w.id))
			assert.True(t, b.IsAvailable())
			if c.plain {
				assert.Empty(t, sb.opens)
			} else {
				assert.Len(t, sb.opens, 1)
			}
			assert.Empty(t, m.made, "no engine without the region")
			for name, err := range llCalls(b) {
				assert.True(t, IsNotAvailable(err), "%s: %v", name, err)
				assert.EqualError(t, err, fmt.Sprintf(c.want, name))
			}
			// get_local_buffer_tensor(use_rdma_buffer=True): there is no region, for the same reason.
			_, _, err = b.LocalData(true)
			assert.True(t, IsNotAvailable(err), "%v", err)
			assert.EqualError(t, err, fmt.Sprintf(c.want, "use_rdma_buffer=True"))
			require.NoError(t, b.Destroy())
			assert.NotContains(t, w.events(), fmt.Sprintf("close symmetric %d", c.me))
		})
	}
}

// A root id that is not NVSHMEM's is the caller's mistake: sync fails with an ArgumentError
// before NVSHMEM is asked (wrong size) or as NVSHMEM's check says (wrong content), the NVLink
// peers it opened are closed again, and the buffer stays unsynced, so that sync with rank 0's
// id then works.
func TestNVSHMEMSyncBadRoot(t *testing.T) {
	g := newSymGroup(t, 4, 2, 1<<12, false)
	b, be, w := g.bufs[1], g.backends[1], g.w

	err := b.Sync(g.devices, g.handles, []byte("short"))
	assert.True(t, IsArgument(err), "%v", err)
	assert.EqualError(t, err, "sync rank 1: root_unique_id has 5 bytes: expected the 128 of get_local_nvshmem_unique_id()")
	assert.Empty(t, be.opens)

	other := make([]byte, UniqueIDBytes)
	err = b.Sync(g.devices, g.handles, other)
	assert.True(t, IsArgument(err), "%v", err)
	assert.EqualError(t, err, "sync rank 1: root_unique_id is not rank 0's get_local_nvshmem_unique_id()")
	assert.Len(t, be.opens, 1)
	assert.False(t, b.IsAvailable())
	assert.Empty(t, g.m.made)
	for name, err := range llCalls(b) {
		assert.ErrorIs(t, err, errNotSynced, name)
	}
	// The region is made at sync: before it, the RDMA buffer is not there yet.
	_, _, err = b.LocalData(true)
	assert.ErrorIs(t, err, errNotSynced)
	// Each failed sync opened rank 0's NVLink buffer and closed it again.
	assert.Equal(t, []string{"open nvl-token-0", "close peer nvl-token-0 on 1", "open nvl-token-0", "open symmetric 1",
		"close peer nvl-token-0 on 1"}, w.events()[4:])

	require.NoError(t, g.sync(1))
	assert.True(t, b.IsAvailable())
	assert.Equal(t, w.id, be.opens[1].Root)
	assert.Equal(t, []bool{false, false, true, true}, g.engineOf(t, 1).env.Remote)
	err = g.sync(1)
	assert.EqualError(t, err, "sync rank 1: already synced; a buffer syncs once")
	require.NoError(t, b.Destroy())
	assert.Equal(t, 1, be.regions[0].closes)
}

// A failure of NVSHMEM that is not its absence (another group, a heap too small, a bootstrap
// that timed out) fails sync as it is; nothing is left open and sync may be tried again.
func TestNVSHMEMSyncFails(t *testing.T) {
	g := newSymGroup(t, 2, 1, 0, false)
	b, be := g.bufs[0], g.backends[0]
	be.openErr = errors.New("pyep: this process is PE 1 of 4 in the NVSHMEM group an earlier buffer across nodes made")
	err := g.sync(0)
	assert.EqualError(t, err, "sync rank 0: pyep: this process is PE 1 of 4 in the NVSHMEM group an earlier buffer across nodes made")
	assert.False(t, IsArgument(err) || IsNotAvailable(err))
	assert.False(t, b.IsAvailable())
	assert.Empty(t, g.m.made)
	be.openErr = nil
	require.NoError(t, g.sync(0))
	assert.Len(t, be.opens, 2)
	require.NoError(t, b.Destroy())
}

// An engine that cannot be made fails sync, and the region goes with it, once; sync then
// allocates a new one, and Destroy closes only that.
func TestNVSHMEMEngineFailure(t *testing.T) {
	g := newSymGroup(t, 2, 1, 0, false)
	b, be, w := g.bufs[1], g.backends[1], g.w
	g.m.err = errors.New("stub: no engine")
	err := g.sync(1)
	assert.EqualError(t, err, "sync rank 1: low-latency engine over NVSHMEM: stub: no engine")
	assert.False(t, b.IsAvailable())
	require.Len(t, be.regions, 1)
	assert.Equal(t, 1, be.regions[0].closes)
	assert.Equal(t, []string{"open symmetric 1", "make engine 1", "close symmetric 1"}, w.events())

	// The region's own failure to close joins the engine's.
	be.closeErr = errors.New("stub: nvshmem_free timed out")
	err = g.sync(1)
	assert.EqualError(t, err, "sync rank 1: low-latency engine over NVSHMEM: stub: no engine\nstub: nvshmem_free timed out")
	be.closeErr = nil

	g.m.err = nil
	require.NoError(t, g.sync(1))
	require.Len(t, be.regions, 3)
	require.NoError(t, b.Destroy())
	assert.Equal(t, []int{1, 1, 1}, []int{be.regions[0].closes, be.regions[1].closes, be.regions[2].closes})
	assert.Equal(t, []string{"close engine 1", "close symmetric 1"}, w.events()[len(w.events())-2:])
}

// allow_nvlink_for_low_latency_mode=False on one node: NVSHMEM all the same, and every peer is
// reached by puts (NVSHMEM is not even asked for their mappings).
func TestNVSHMEMNoNVLinkOneNode(t *testing.T) {
	g := newSymGroup(t, 4, 0, 0, true)
	assert.Equal(t, g.w.id, g.root)
	for r := range 4 {
		require.NoError(t, g.sync(r))
	}
	e := g.engineOf(t, 2)
	assert.Equal(t, []bool{true, true, false, true}, e.env.Remote)
	assert.Equal(t, []unsafe.Pointer{nil, nil, heapPtr(g.w, 2), nil}, e.regions)
	assert.Empty(t, g.backends[2].regions[0].peers)
	assert.Equal(t, symOpen{Root: g.w.id, Rank: 2, NumRanks: 4, NumBytes: symRDMABytes}, g.backends[2].opens[0])
	for _, b := range g.bufs {
		require.NoError(t, b.Destroy())
	}
}

// A peer of this node that NVSHMEM does not map (no P2P between the GPUs) is reached by puts.
func TestNVSHMEMUnmappedPeer(t *testing.T) {
	g := newSymGroup(t, 4, 2, 0, false)
	g.w.mapped = func(me, p int) bool { return !(me == 1 && p == 0) }
	for r := range 4 {
		require.NoError(t, g.sync(r))
	}
	assert.Equal(t, []bool{true, false, true, true}, g.engineOf(t, 1).env.Remote)
	assert.Equal(t, []unsafe.Pointer{nil, heapPtr(g.w, 1), nil, nil}, g.engineOf(t, 1).regions)
	assert.Equal(t, []bool{false, false, true, true}, g.engineOf(t, 0).env.Remote)
	assert.Equal(t, []unsafe.Pointer{heapPtr(g.w, 0), heapPtr(g.w, 1), nil, nil}, g.engineOf(t, 0).regions)
}

// Without a device engine to run the calls, sync allocates no region: the calls and the RDMA
// buffer's view say the mode is not available.
func TestNVSHMEMNoEngineMaker(t *testing.T) {
	w := newSymWorld()
	be := &symBackend{w: w}
	b, err := NewBuffer(Params{Rank: 0, NumRanks: 2, NumRDMABytes: symRDMABytes, LowLatencyMode: true, RanksPerNode: 1}, be)
	require.NoError(t, err)
	require.NoError(t, b.Sync([]int{0, 0}, make([][]byte, 2), w.id))
	assert.Empty(t, be.opens)
	for name, err := range llCalls(b) {
		assert.EqualError(t, err, name+": low-latency mode is not available on the stub backend with 2 ranks")
	}
	_, _, err = b.LocalData(true)
	assert.EqualError(t, err, "use_rdma_buffer=True: low-latency mode is not available on the stub backend with 2 ranks")
	require.NoError(t, b.Destroy())
}

// A buffer whose RDMA region cannot be allocated fails to be made, and frees its NVLink buffer
// if it has one.
func TestNewBufferRDMAFailure(t *testing.T) {
	w := newSymWorld()
	be := &symBackend{w: w, allocFails: symRDMABytes}
	// One node in low-latency mode: the region is shared (Allocate), not in NVSHMEM's heap.
	_, err := NewBuffer(Params{Rank: 0, NumRanks: 2, NumRDMABytes: symRDMABytes, LowLatencyMode: true}, be)
	assert.EqualError(t, err, "rank 0: allocate 1048576 RDMA-buffer bytes on stub: stub: out of memory")
	_, err = NewBuffer(Params{Rank: 0, NumRanks: 2, NumNVLBytes: 1 << 12, NumRDMABytes: symRDMABytes, LowLatencyMode: true}, be)
	assert.EqualError(t, err, "rank 0: allocate 1048576 RDMA-buffer bytes on stub: stub: out of memory")
	assert.Equal(t, []string{"allocate nvl 0", "allocate nvl 0", "allocate nvl 0", "close nvl 0"}, w.events())
}

// devTokenBackend is the stub with DeviceTokens: its buffers without an NVLink region name their
// GPU in their handles.
type devTokenBackend struct{ *symBackend }

func (d devTokenBackend) DeviceToken() []byte { return []byte(fmt.Sprintf("gpu-of-%d", d.rank)) }

// With num_nvl_bytes = 0 (DeepEP's usual low-latency setup) the engine across nodes still gets
// every rank's GPU from the handles, so that it knows which ranks share its GPU.
func TestNVSHMEMDeviceTokens(t *testing.T) {
	const n = 4
	w := newSymWorld()
	m := &stubMaker{w: w}
	bufs, handles := make([]*Buffer, n), make([][]byte, n)
	for r := range n {
		b, err := NewBuffer(Params{Rank: r, NumRanks: n, NumRDMABytes: symRDMABytes, LowLatencyMode: true, RanksPerNode: 2,
			Engines: Engines{LowLatency: m.maker}}, devTokenBackend{&symBackend{w: w, rank: r}})
		require.NoError(t, err)
		bufs[r] = b
		handles[r], err = b.LocalIPCHandle()
		require.NoError(t, err)
	}
	root, err := bufs[0].LocalNVSHMEMUniqueID()
	require.NoError(t, err)
	for r := range n {
		require.NoError(t, bufs[r].Sync(make([]int, n), handles, root))
	}
	require.Len(t, m.made, n)
	for _, e := range m.made {
		assert.Equal(t, [][]byte{[]byte("gpu-of-0"), []byte("gpu-of-1"), []byte("gpu-of-2"), []byte("gpu-of-3")}, e.tokens,
			"rank %d's engine", e.env.Topo.Rank)
	}
	for _, b := range bufs {
		require.NoError(t, b.Destroy())
	}
}

// Ranks that made their buffers with different num_rdma_bytes: every rank's sync says so, naming
// the argument, before any rank enters NVSHMEM (whose allocation is collective and would not
// agree), and nothing is left open.
func TestNVSHMEMMismatchedRDMABytes(t *testing.T) {
	g := newSymGroup(t, 2, 1, 0, false)
	be := &symBackend{w: g.w, rank: 1}
	other, err := NewBuffer(Params{Rank: 1, NumRanks: 2, NumRDMABytes: 2 * symRDMABytes, LowLatencyMode: true,
		RanksPerNode: 1, Engines: Engines{LowLatency: g.m.maker}}, be)
	require.NoError(t, err)
	h, err := other.LocalIPCHandle()
	require.NoError(t, err)
	g.bufs[1], g.backends[1], g.handles[1] = other, be, h
	for r := range 2 {
		err := g.sync(r)
		require.Error(t, err, "rank %d", r)
		assert.True(t, IsArgument(err), err.Error())
		assert.Contains(t, err.Error(), fmt.Sprintf("ipc_handles[%d]: rank %d made its buffer with num_rdma_bytes = ", 1-r, 1-r))
		assert.Contains(t, err.Error(), "expected the same num_rdma_bytes on every rank")
		assert.Empty(t, g.backends[r].opens, "rank %d entered NVSHMEM", r)
		assert.False(t, g.bufs[r].IsAvailable())
	}
	assert.Empty(t, g.m.made)
	for r := range 2 {
		require.NoError(t, g.bufs[r].Destroy())
	}
}

// A peer that failed the engine (a timeout it recorded): destroy abandons the NVSHMEM region
// instead of entering the collective free, which that peer would never join, and says why.
func TestNVSHMEMDestroyAfterPeerFailure(t *testing.T) {
	g := newSymGroup(t, 2, 1, 0, false)
	for r := range 2 {
		require.NoError(t, g.sync(r))
	}
	g.engineOf(t, 0).failed = errors.New("rank 0 timed out waiting for rank 1")
	err := g.bufs[0].Destroy()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "abandoned: rank 0 timed out waiting for rank 1")
	assert.Contains(t, g.w.events(), "abandon symmetric 0")
	assert.NotContains(t, g.w.events(), "close symmetric 0")
	assert.Equal(t, 1, g.engineOf(t, 0).closes, "the engine still closes")
	require.NoError(t, g.bufs[1].Destroy(), "a rank with no failure frees as before")
	assert.Contains(t, g.w.events(), "close symmetric 1")
}
