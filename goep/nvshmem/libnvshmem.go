//go:build cgo

package nvshmem

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include "libnvshmem.h"

// The file the loader actually mapped, for messages and for finding the installation: a bare
// soname says neither.
static const char* pyep_nvshmem_loaded_path(void) {
	Dl_info info;
	if (dladdr(pyep_nvshmem_fp[SH_MY_PE], &info) == 0 || info.dli_fname == NULL) return "";
	return info.dli_fname;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/pyep/pyep/goep/dl"
)

// table is the host library's entry points as goep/dl resolves them, from pyep_nvshmem_names.
func table() []dl.Symbol {
	t := make([]dl.Symbol, C.SH_COUNT)
	for i := range t {
		t[i] = dl.Symbol{C.GoString(C.pyep_nvshmem_name(C.int(i)))}
	}
	return t
}

// load opens the first candidate that loads and exports every entry point. Only one NVSHMEM
// can be bound (the pointers are process-wide, like NVSHMEM itself), so the first success wins.
func load(candidates []string) (*Library, error) {
	var tried []string
	for _, c := range candidates {
		found, err := dl.Open(c, table(), dl.Options{})
		if err != nil {
			var missing *dl.MissingError
			var open *dl.OpenError
			msg := err.Error()
			if errors.As(err, &missing) {
				msg = fmt.Sprintf("it lacks %s (not NVSHMEM 3?)", missing.Symbol)
			} else if errors.As(err, &open) {
				msg = open.Detail
			}
			tried = append(tried, fmt.Sprintf("%s (%s)", c, msg))
			continue
		}
		for i, fp := range found.Addrs {
			C.pyep_nvshmem_set(C.int(i), C.uintptr_t(fp))
		}
		var major, minor, patch C.int
		C.pyep_nvshmem_version(&major, &minor, &patch)
		l := &Library{Path: C.GoString(C.pyep_nvshmem_loaded_path()),
			Version: Version{int(major), int(minor), int(patch)}, heap: map[uintptr]int{}}
		if l.Path == "" {
			l.Path = c
		}
		l.Install = installOf(l.Path)
		return l, nil
	}
	return nil, &NotFoundError{Tried: tried}
}

// GetUniqueID makes a fresh unique id (nvshmemx_get_uniqueid): the root PE's, for every PE of
// the group to pass to Init. It needs no GPU and no init; it names this host's address and a
// port for the bootstrap to meet at.
func (l *Library) GetUniqueID() (UniqueID, error) {
	var id UniqueID
	if r := C.pyep_nvshmem_get_uniqueid(unsafe.Pointer(&id[0])); r != 0 {
		return UniqueID{}, fmt.Errorf("pyep: nvshmem: unique id: %w", &Error{Op: "nvshmemx_get_uniqueid", Status: int(r)})
	}
	return id, nil
}

// Init joins the group g describes (nvshmemx_set_attr_uniqueid_args, then
// nvshmemx_hostlib_init_attr with NVSHMEMX_INIT_WITH_UNIQUEID): collective, it returns once
// every PE has called it, or fails. It needs the GPU: NVSHMEM sets up its symmetric heap
// (NVSHMEM_SYMMETRIC_SIZE) on the device.
func (l *Library) Init(g Group) error {
	if err := g.check(); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.initDone {
		return errors.New("pyep: nvshmem: already initialised (Finalize first)")
	}
	var stage C.int
	r := C.pyep_nvshmem_init_uniqueid(unsafe.Pointer(&g.ID[0]), C.int(g.Rank), C.int(g.Ranks), C.int(g.Device), &stage)
	if r != 0 {
		op := [...]string{"nvshmemx_set_attr_uniqueid_args", "nvshmemx_hostlib_init_attr"}[stage]
		return fmt.Errorf("pyep: nvshmem: init PE %d of %d: %w", g.Rank, g.Ranks, &Error{Op: op, Status: int(r)})
	}
	pe, npes := int(C.pyep_nvshmem_my_pe()), int(C.pyep_nvshmem_n_pes())
	if pe != g.Rank || npes != g.Ranks {
		// NVSHMEM is up: leave it so, but say that it is not the group asked for.
		l.initDone, l.pe, l.npes = true, pe, npes
		return fmt.Errorf("pyep: nvshmem: init as PE %d of %d made PE %d of %d", g.Rank, g.Ranks, pe, npes)
	}
	l.initDone, l.pe, l.npes = true, pe, npes
	return nil
}

// InitStatus is nvshmemx_init_status: 0 not initialised, 1 bootstrapped, 2 initialised, more for
// multi-process-per-GPU modes (device_host_transport/nvshmem_constants.h).
func (l *Library) InitStatus() int { return int(C.pyep_nvshmem_init_status()) }

// Finalize leaves the group (nvshmemx_hostlib_finalize): collective. The symmetric heap goes
// with it, so every pointer Malloc returned is invalid after.
func (l *Library) Finalize() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.initDone {
		return ErrNotInitialized
	}
	C.pyep_nvshmem_finalize()
	l.initDone, l.heap, l.heapBytes = false, map[uintptr]int{}, 0
	return nil
}

// Malloc allocates size bytes of the symmetric heap (nvshmem_malloc): collective, with the same
// size on every PE, so that an offset into it names the same bytes on each.
func (l *Library) Malloc(size int) (uintptr, error) {
	if size <= 0 {
		return 0, fmt.Errorf("pyep: nvshmem: malloc of %d bytes: expected a positive size", size)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.initDone {
		return 0, ErrNotInitialized
	}
	p := uintptr(C.pyep_nvshmem_malloc(C.size_t(size)))
	if p == 0 {
		return 0, fmt.Errorf("pyep: nvshmem: malloc of %d bytes failed (%d bytes in use; the heap is NVSHMEM_SYMMETRIC_SIZE)", size, l.heapBytes)
	}
	l.heap[p] = size
	l.heapBytes += size
	return p, nil
}

// Free returns p, which Malloc returned, to the heap (nvshmem_free): collective. Any other
// pointer is refused (NVSHMEM would end the process over some).
func (l *Library) Free(p uintptr) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.initDone {
		return ErrNotInitialized
	}
	size, ok := l.heap[p]
	if !ok {
		return fmt.Errorf("pyep: nvshmem: free of %#x, which Malloc did not return (or already freed)", p)
	}
	C.pyep_nvshmem_free(C.uintptr_t(p))
	delete(l.heap, p)
	l.heapBytes -= size
	return nil
}

// BarrierAll waits for every PE to arrive and completes every PE's outstanding puts
// (nvshmem_barrier_all): collective.
func (l *Library) BarrierAll() error {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if !l.initDone {
		return ErrNotInitialized
	}
	C.pyep_nvshmem_barrier_all()
	return nil
}

// Ptr is where this process's device code reaches pe's copy of the symmetric address p by loads
// and stores (nvshmem_ptr), or 0 where it cannot (another node: puts and gets only).
func (l *Library) Ptr(p uintptr, pe int) (uintptr, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if !l.initDone {
		return 0, ErrNotInitialized
	}
	if pe < 0 || pe >= l.npes {
		return 0, fmt.Errorf("pyep: nvshmem: ptr for PE %d: expected 0 <= pe < %d", pe, l.npes)
	}
	return uintptr(C.pyep_nvshmem_ptr(C.uintptr_t(p), C.int(pe))), nil
}

// ModuleInit gives a loaded module (a CUmodule, as goep/cuda/driver's Module.Raw) NVSHMEM's
// device state (nvshmemx_cumodule_init): once per module linked with libnvshmem_device.a,
// after Init and before the module's first launch.
func (l *Library) ModuleInit(module uintptr) error {
	return l.module("nvshmemx_cumodule_init", module, func(m C.uintptr_t) C.int { return C.pyep_nvshmem_cumodule_init(m) })
}

// ModuleFinalize undoes ModuleInit (nvshmemx_cumodule_finalize), before the module unloads.
func (l *Library) ModuleFinalize(module uintptr) error {
	return l.module("nvshmemx_cumodule_finalize", module, func(m C.uintptr_t) C.int { return C.pyep_nvshmem_cumodule_finalize(m) })
}

func (l *Library) module(op string, module uintptr, call func(C.uintptr_t) C.int) error {
	if module == 0 {
		return fmt.Errorf("pyep: nvshmem: %s of a null module", op)
	}
	l.mu.RLock()
	defer l.mu.RUnlock()
	if !l.initDone {
		return ErrNotInitialized
	}
	if r := call(C.uintptr_t(module)); r != 0 {
		return fmt.Errorf("pyep: nvshmem: module %#x: %w", module, &Error{Op: op, Status: int(r)})
	}
	return nil
}
