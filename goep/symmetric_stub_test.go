package goep

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/lowlatency"
)

// A stand-in for the cuda backend's NVSHMEM path, over host memory, for goep's side of it
// (low_latency_nvshmem.go): a device backend (DeviceID 0) that implements SymmetricBackend and
// records what goep asks of it, and a device low-latency engine that records how it was made.
// The ranks' backends share one world (their "symmetric heap" and one event log), as the
// processes of one NVSHMEM group share NVSHMEM.

// symWorld is what the ranks' backends share: the unique id the root hands out, each rank's
// region in the heap, which peers NVSHMEM maps on which rank, and every event in order.
type symWorld struct {
	mu     sync.Mutex
	id     []byte
	heap   map[int][]byte // by PE
	mapped func(me, p int) bool
	log    []string
}

func newSymWorld() *symWorld {
	id := make([]byte, UniqueIDBytes)
	for i := range id {
		id[i] = byte(i*7 + 1)
	}
	return &symWorld{id: id, heap: map[int][]byte{}, mapped: func(int, int) bool { return true }}
}

// region is PE p's region: the symmetric allocation is collective, so a peer's exists (at the
// same size) as soon as any PE's does, whichever rank's OpenSymmetric ran first here.
func (w *symWorld) region(p int, numBytes int64) []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.regionLocked(p, numBytes)
}

func (w *symWorld) regionLocked(p int, numBytes int64) []byte {
	if w.heap[p] == nil {
		w.heap[p] = make([]byte, numBytes)
	}
	return w.heap[p]
}

func (w *symWorld) event(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.log = append(w.log, fmt.Sprintf(format, args...))
}

func (w *symWorld) events() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.log...)
}

// symOpen is one OpenSymmetric call's arguments.
type symOpen struct {
	Root           []byte
	Rank, NumRanks int
	NumBytes       int64
}

// symBackend is one rank's backend.
type symBackend struct {
	w    *symWorld
	rank int
	// What the next calls answer with (nil: success).
	idErr, openErr, closeErr error
	allocFails               int64 // Allocate of this size fails
	opens                    []symOpen
	ids                      int // NVSHMEMUniqueID calls
	regions                  []*symRegion
}

func (s *symBackend) Name() string  { return "stub" }
func (s *symBackend) DeviceID() int { return 0 }

func (s *symBackend) Allocate(size int64, numPeers int) (LocalRegion, error) {
	s.w.event("allocate nvl %d", s.rank)
	if size == s.allocFails {
		return nil, errors.New("stub: out of memory")
	}
	return &hostRegion{w: s.w, name: fmt.Sprintf("nvl %d", s.rank), mem: make([]byte, ControlBytes+size),
		token: []byte(fmt.Sprintf("nvl-token-%d", s.rank))}, nil
}

func (s *symBackend) Open(token []byte, size int64) (Region, error) {
	s.w.event("open %s", token)
	return &hostRegion{w: s.w, name: fmt.Sprintf("peer %s on %d", token, s.rank), mem: make([]byte, ControlBytes+size)}, nil
}

func (s *symBackend) AllocateRDMA(size int64) (RDMARegion, error) {
	s.w.event("allocate rdma %d", s.rank)
	return nil, errors.New("stub: AllocateRDMA: a buffer over NVSHMEM allocates its region at sync")
}

func (s *symBackend) NVSHMEMUniqueID() ([]byte, error) {
	s.ids++
	if s.idErr != nil {
		return nil, s.idErr
	}
	return append([]byte(nil), s.w.id...), nil
}

func (s *symBackend) OpenSymmetric(root []byte, rank, numRanks int, numBytes int64) (SymmetricRegion, error) {
	s.opens = append(s.opens, symOpen{Root: append([]byte(nil), root...), Rank: rank, NumRanks: numRanks, NumBytes: numBytes})
	s.w.event("open symmetric %d", rank)
	if s.openErr != nil {
		return nil, s.openErr
	}
	if string(root) != string(s.w.id) {
		return nil, Argf("root_unique_id is not rank 0's get_local_nvshmem_unique_id()")
	}
	r := &symRegion{b: s, rank: rank, mem: s.w.region(rank, numBytes)}
	s.regions = append(s.regions, r)
	return r, nil
}

// symRegion is a rank's region in the world's heap; Peer is NVSHMEM's nvshmem_ptr.
type symRegion struct {
	b      *symBackend
	rank   int
	mem    []byte
	closes int
	peers  []int // Peer's arguments
}

func (r *symRegion) Data() unsafe.Pointer { return unsafe.Pointer(&r.mem[0]) }

func (r *symRegion) Peer(p int) unsafe.Pointer {
	r.peers = append(r.peers, p)
	w := r.b.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.mapped(r.rank, p) {
		return nil
	}
	return unsafe.Pointer(&w.regionLocked(p, int64(len(r.mem)))[0])
}

func (r *symRegion) Abandon(cause error) error {
	r.b.w.event("abandon symmetric %d", r.rank)
	return fmt.Errorf("abandoned: %w", cause)
}

func (r *symRegion) Close() error {
	r.closes++
	r.b.w.event("close symmetric %d", r.rank)
	return r.b.closeErr
}

// hostRegion is an NVLink-domain region (own or a peer's) in host memory.
type hostRegion struct {
	w     *symWorld
	name  string
	mem   []byte
	token []byte
}

func (h *hostRegion) Control() unsafe.Pointer { return unsafe.Pointer(&h.mem[0]) }
func (h *hostRegion) Data() unsafe.Pointer    { return unsafe.Pointer(&h.mem[ControlBytes]) }
func (h *hostRegion) Token() []byte           { return h.token }
func (h *hostRegion) Close() error            { h.w.event("close %s", h.name); return nil }

// stubEngine is a device low-latency engine that records what it was made with and called for.
type stubEngine struct {
	w        *symWorld
	env      EngineEnv
	regions  []unsafe.Pointer
	numBytes int64
	tokens   [][]byte
	timeout  time.Duration
	launches []bool // combine, per Launch
	cleans   int
	closes   int
	failed   error // PeerFailure's answer
}

func (e *stubEngine) PeerFailure() error { return e.failed }

// stubMaker is Params.Engines.LowLatency over stubEngine: made holds every engine made, err
// (when set) fails the making.
type stubMaker struct {
	w    *symWorld
	made []*stubEngine
	err  error
}

func (m *stubMaker) maker(env EngineEnv, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (DeviceLowLatency, error) {
	m.w.event("make engine %d", env.Topo.Rank)
	if m.err != nil {
		return nil, m.err
	}
	e := &stubEngine{w: m.w, env: env, regions: regions, numBytes: numBytes, tokens: tokens}
	m.made = append(m.made, e)
	return e, nil
}

func (e *stubEngine) Close() error {
	e.closes++
	e.w.event("close engine %d", e.env.Topo.Rank)
	return nil
}

func (e *stubEngine) Launch(combine bool, c *LLCall) (LLReceive, error) {
	e.launches = append(e.launches, combine)
	return nil, nil
}

func (e *stubEngine) Clean(s lowlatency.Shape, masks bool) error { e.cleans++; return nil }
func (e *stubEngine) SetMask(p int, on bool) error               { return nil }
func (e *stubEngine) Masks(out []int32) error                    { return nil }
func (e *stubEngine) SetTimeout(d time.Duration)                 { e.timeout = d }
func (e *stubEngine) NextSend(s lowlatency.Shape) (int64, error) { return 0, nil }

var (
	_ Backend          = (*symBackend)(nil)
	_ SymmetricBackend = (*symBackend)(nil)
	_ DeviceLowLatency = (*stubEngine)(nil)
)
