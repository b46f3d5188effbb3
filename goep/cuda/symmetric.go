package cuda

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/env"
	"github.com/pyep/pyep/goep/nvshmem"
)

// Low-latency mode across nodes: the buffer's region lives in NVSHMEM's symmetric heap, so that
// a peer on another node is reached by a put to the same offset (kernels/remote.cuh), and a
// peer that NVSHMEM maps (same node, P2P) by its pointer (nvshmem_ptr).
//
// NVSHMEM is one group per process, and it cannot be initialised twice (a second init, even after
// finalize, is undefined): the first buffer across nodes joins the group from its root unique id,
// and the group stays until the process exits. Later buffers, of the same ranks, allocate their
// regions in it (their root id is not needed); each buffer's destroy frees its region only. The
// heap is sized when the group is made, from the first buffer's num_rdma_bytes or
// NVSHMEM_SYMMETRIC_SIZE.

// group is this process's NVSHMEM group as pyep made it: the heap size it was made with, and
// the error of a bootstrap that never finished (NVSHMEM is then unusable in this process).
var group struct {
	sync.Mutex
	id    nvshmem.UniqueID // the root's unique id the group was made from
	heap  string
	stuck error
}

// SymmetricSizeEnv is NVSHMEM's heap size variable, which NVSHMEM reads at init.
const SymmetricSizeEnv = "NVSHMEM_SYMMETRIC_SIZE"

// heapSlack is what the heap holds beyond the buffer's region: NVSHMEM's own symmetric objects
// (team and collective state).
const heapSlack = 128 << 20

// heapPage is the granularity NVSHMEM maps its heap in.
const heapPage = 2 << 20

// SymmetricHeapBytes is the heap a region of numBytes needs: the region, NVSHMEM's own objects,
// in whole 2 MiB pages.
func SymmetricHeapBytes(numBytes int64) int64 {
	return (numBytes + heapSlack + heapPage - 1) / heapPage * heapPage
}

// HeapSetting decides NVSHMEM_SYMMETRIC_SIZE for a region of numBytes, given the user's value
// (""): the value to set ("" to keep the user's), or an error naming what to change.
func HeapSetting(user string, numBytes int64) (string, error) {
	if user == "" {
		return strconv.FormatInt(SymmetricHeapBytes(numBytes), 10), nil
	}
	n, err := parseSize(user)
	if err != nil {
		return "", goep.Argf("%s = %q: %v", SymmetricSizeEnv, user, err)
	}
	if n < numBytes+heapSlack/4 {
		return "", goep.Argf("%s = %s (%d bytes) cannot hold num_rdma_bytes = %d and NVSHMEM's own objects: set it to at "+
			"least %d, or unset it (pyep then asks for %d)", SymmetricSizeEnv, user, n, numBytes, numBytes+heapSlack/4,
			SymmetricHeapBytes(numBytes))
	}
	return "", nil
}

// parseSize reads NVSHMEM's size syntax: bytes, or a number with a K, M, G or T suffix.
func parseSize(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	mult := int64(1)
	if t != "" {
		if i := strings.IndexByte("KMGT", t[len(t)-1]); i >= 0 {
			mult, t = int64(1)<<(10*(i+1)), strings.TrimSuffix(t[:len(t)-1], "I")
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n <= 0 {
		return 0, errors.New("expected a positive size in bytes, or with a K, M, G or T suffix")
	}
	return n * mult, nil
}

// notAvailable is the error of a buffer that needs NVSHMEM where it cannot run.
func notAvailable(why error) error {
	return goep.NotAvailablef("NVSHMEM is not available: %v", why)
}

// library is the NVSHMEM this backend may bootstrap, or a NotAvailableError.
func (b *Backend) library() (*nvshmem.Library, error) {
	if !b.nvshmem {
		return nil, notAvailable(errors.New("this cuda backend was made without it (BackendOptions.NVSHMEM, which tests over the fake driver leave off)"))
	}
	lib, err := nvshmem.Open()
	if err != nil {
		return nil, notAvailable(err)
	}
	if _, _, err := lib.Install.DeviceLink(); err != nil {
		return nil, notAvailable(err)
	}
	return lib, nil
}

// NVSHMEMUniqueID implements goep.SymmetricBackend: nvshmemx_get_uniqueid, for the root rank
// (the group's own id once this process is in it).
func (b *Backend) NVSHMEMUniqueID() ([]byte, error) {
	lib, err := b.library()
	if err != nil {
		return nil, err
	}
	group.Lock()
	defer group.Unlock()
	if lib.Initialized() {
		// The process is in its group already: no new id (a fresh one would start a bootstrap
		// that no rank joins); the buffer's sync allocates in the group.
		id := group.id
		return id[:], nil
	}
	id, err := lib.GetUniqueID()
	if err != nil {
		return nil, err
	}
	return id[:], nil
}

// OpenSymmetric implements goep.SymmetricBackend: unless this process is in NVSHMEM's group
// already (as rank of numRanks: see group), it joins it as PE rank of numRanks from root (the
// root rank's NVSHMEMUniqueID), with a heap that holds numBytes (HeapSetting); then it allocates
// the region there, zeroed on every PE before it returns (collective: every rank of the group
// calls it at sync).
func (b *Backend) OpenSymmetric(root []byte, rank, numRanks int, numBytes int64) (goep.SymmetricRegion, error) {
	lib, err := b.library()
	if err != nil {
		return nil, err
	}
	var id nvshmem.UniqueID
	if len(root) != len(id) {
		return nil, goep.Argf("root_unique_id has %d bytes: expected NVSHMEM's %d", len(root), len(id))
	}
	copy(id[:], root)
	if err := id.Check(); err != nil {
		return nil, goep.Argf("root_unique_id is not rank 0's get_local_nvshmem_unique_id() of a cuda buffer across nodes: %v", err)
	}
	group.Lock()
	defer group.Unlock()
	if group.stuck != nil {
		return nil, group.stuck
	}
	if lib.Initialized() {
		if err := sameGroup(lib, rank, numRanks); err != nil {
			return nil, err
		}
	} else if err := b.joinGroup(lib, nvshmem.Group{ID: id, Rank: rank, Ranks: numRanks, Device: b.DeviceID()}, numBytes); err != nil {
		return nil, err
	}
	r, err := b.allocSymmetric(lib, numBytes)
	if err != nil {
		return nil, fmt.Errorf("pyep: NVSHMEM's symmetric heap (%s = %s when this process joined NVSHMEM, %d bytes held "+
			"by other buffers): a region of num_rdma_bytes = %d: %w; the heap cannot grow: set %s to at least %d before "+
			"the process's first buffer across nodes", SymmetricSizeEnv, group.heap, lib.HeapBytes(), numBytes, err,
			SymmetricSizeEnv, SymmetricHeapBytes(int64(lib.HeapBytes())+numBytes))
	}
	return r, nil
}

// joinGroup makes this process's NVSHMEM group with a heap for a first region of numBytes.
func (b *Backend) joinGroup(lib *nvshmem.Library, g nvshmem.Group, numBytes int64) error {
	if st := lib.InitStatus(); st != 0 {
		return fmt.Errorf("pyep: NVSHMEM is initialised in this process by another user of the library (status %d; "+
			"DeepEP's low-latency Buffer is one): NVSHMEM is one group per process, so pyep cannot make its own", st)
	}
	set, err := HeapSetting(env.Get(SymmetricSizeEnv), numBytes)
	if err != nil {
		return err
	}
	if set != "" {
		// NVSHMEM reads it at init (os.Setenv reaches the C environment in a cgo build).
		if err := os.Setenv(SymmetricSizeEnv, set); err != nil {
			return err
		}
	}
	group.heap, group.id = os.Getenv(SymmetricSizeEnv), g.ID
	return b.initNVSHMEM(lib, g)
}

// sameGroup checks that a buffer of numRanks ranks, this one rank, fits the group this process
// joined for an earlier buffer.
func sameGroup(lib *nvshmem.Library, rank, numRanks int) error {
	pe, err := lib.MyPE()
	if err != nil {
		return err
	}
	n, err := lib.NPEs()
	if err != nil {
		return err
	}
	return groupFits(pe, n, rank, numRanks)
}

// groupFits: this process is PE pe of n; a new buffer wants it as rank of numRanks.
func groupFits(pe, n, rank, numRanks int) error {
	if pe != rank || n != numRanks {
		return fmt.Errorf("pyep: this process is PE %d of %d in the NVSHMEM group an earlier buffer across nodes made, and "+
			"NVSHMEM is one group per process for the process's life: a buffer across nodes here must be rank %d of %d "+
			"ranks, not rank %d of %d", pe, n, pe, n, rank, numRanks)
	}
	return nil
}

// collective runs f, one of NVSHMEM's collective calls, with the context current, bounded by the
// backend's timeout: NVSHMEM's collectives have no bound of their own when a rank never comes.
// On a timeout f is left running (nothing can stop it), and NVSHMEM is unusable in the process.
func (b *Backend) collective(f func() error) (timedOut bool, err error) {
	done := make(chan error, 1)
	go func() {
		exit, err := b.Enter()
		defer exit()
		if err == nil {
			err = f()
		}
		done <- err
	}()
	select {
	case err := <-done:
		return false, err
	case <-time.After(b.timeout):
		return true, nil
	}
}

// initNVSHMEM runs NVSHMEM's collective init (with group locked), bounded (collective).
func (b *Backend) initNVSHMEM(lib *nvshmem.Library, g nvshmem.Group) error {
	timedOut, err := b.collective(func() error { return lib.Init(g) })
	if timedOut {
		group.stuck = fmt.Errorf("pyep: NVSHMEM bootstrap as PE %d of %d did not finish within %v: rank 0 (whose unique id the group "+
			"joins) or another rank did not reach sync, or cannot be reached (NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME names the "+
			"interface; NVSHMEM_DEBUG=INFO says more); this process's NVSHMEM is left unusable", g.Rank, g.Ranks, b.timeout)
		return group.stuck
	}
	if err != nil {
		return fmt.Errorf("pyep: NVSHMEM bootstrap as PE %d of %d: %w", g.Rank, g.Ranks, err)
	}
	return nil
}

// allocSymmetric allocates and zeroes the region on every PE (the barrier: no peer writes into
// a region before its owner zeroed it), with group locked, bounded (collective).
func (b *Backend) allocSymmetric(lib *nvshmem.Library, numBytes int64) (*symmetricRegion, error) {
	var r *symmetricRegion
	timedOut, err := b.collective(func() error {
		p, err := lib.Malloc(int(numBytes))
		if err != nil {
			return err
		}
		base := driver.DevicePtr(p)
		if err := b.drv.MemsetD8(base, 0, int(numBytes)); err != nil {
			return errors.Join(err, lib.Free(p))
		}
		if err := b.drv.CtxSynchronize(); err != nil {
			return errors.Join(err, lib.Free(p))
		}
		if err := lib.BarrierAll(); err != nil {
			return errors.Join(err, lib.Free(p))
		}
		r = &symmetricRegion{b: b, lib: lib, base: base}
		return nil
	})
	if timedOut {
		group.stuck = fmt.Errorf("pyep: NVSHMEM's allocation of the low-latency region (num_rdma_bytes = %d) did not finish "+
			"within %v: nvshmem_malloc and the barrier after it are collective, and a rank of the group did not reach sync; "+
			"this process's NVSHMEM is left unusable", numBytes, b.timeout)
		return nil, group.stuck
	}
	return r, err
}

// symmetricRegion is a buffer's low-latency region in NVSHMEM's symmetric heap.
type symmetricRegion struct {
	b      *Backend
	lib    *nvshmem.Library
	base   driver.DevicePtr
	closed bool
}

func (r *symmetricRegion) Data() unsafe.Pointer { return devicePointer(r.base) }

// Peer is PE p's region as NVSHMEM maps it here (nvshmem_ptr), nil where only puts reach it.
func (r *symmetricRegion) Peer(p int) unsafe.Pointer {
	ptr, err := r.lib.Ptr(uintptr(r.base), p)
	if err != nil || ptr == 0 {
		return nil
	}
	return devicePointer(driver.DevicePtr(ptr))
}

// Abandon implements goep.SymmetricRegion: a peer failed (cause), so the collective free would
// wait for it forever (and NVSHMEM's barrier kernel would hold the GPU): the region stays
// allocated and this process's NVSHMEM unusable; the GPU stays usable.
func (r *symmetricRegion) Abandon(cause error) error {
	if r.closed {
		return nil
	}
	r.closed = true
	group.Lock()
	defer group.Unlock()
	if group.stuck == nil {
		group.stuck = fmt.Errorf("pyep: cuda: the NVSHMEM region was not freed, since a peer failed (%v) and nvshmem_free "+
			"is collective; this process's NVSHMEM is left unusable (its GPU is not)", cause)
	}
	return group.stuck
}

// Close frees the region once the GPU is idle (nvshmem_free: collective, every rank destroys its
// buffer). NVSHMEM itself, and the kernels registered with it, stay for the process's next buffer
// across nodes (see group).
func (r *symmetricRegion) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	b := r.b
	if err := b.SyncDevice(b.timeout); err != nil {
		return fmt.Errorf("pyep: cuda: releasing the NVSHMEM region: %w; the region stays allocated", err)
	}
	group.Lock()
	defer group.Unlock()
	if group.stuck != nil {
		return fmt.Errorf("pyep: cuda: the NVSHMEM region stays allocated: %w", group.stuck)
	}
	timedOut, err := b.collective(func() error { return r.lib.Free(uintptr(r.base)) })
	if timedOut {
		group.stuck = fmt.Errorf("pyep: cuda: freeing the NVSHMEM region did not finish within %v: nvshmem_free is "+
			"collective, and a rank of the group did not destroy its buffer; this process's NVSHMEM is left unusable", b.timeout)
		return group.stuck
	}
	return err
}
