// Package nvshmem binds NVSHMEM's host library, which low-latency mode across nodes needs: the
// unique id a group bootstraps from, init and finalize, the PE's place in the group, the
// symmetric heap, a barrier, nvshmem_ptr, and the call that hands NVSHMEM's device state to a
// module linked at run time (nvshmemx_cumodule_init; goep/jit's CompileLinked links a kernel
// with libnvshmem_device.a into such a module).
//
// The library is opened with goep/dl on first use, never before: a process that does not ask for
// NVSHMEM does not need it installed. Where it is looked for is Candidates'; the device library
// and the headers that kernels compile against come from the same installation (Install), since
// NVSHMEM checks that its host and device halves are of one version.
//
// NVSHMEM is one per process, and some of its calls end the process when misused (nvshmem_free
// and nvshmem_barrier_all before init, nvshmemx_cumodule_init of a null module): Library keeps
// the state it needs to refuse those calls with an error instead.
package nvshmem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/pyep/pyep/goep/dl"
	"github.com/pyep/pyep/goep/env"
)

// DirEnv names an NVSHMEM installation (its lib/ and include/), as DeepEP's build reads it.
const DirEnv = "NVSHMEM_DIR"

// hostLibrary is the host library's name; the .so.3 is NVSHMEM 3's ABI.
const hostLibrary = "libnvshmem_host.so"

// UniqueIDBytes is the size of nvshmemx_uniqueid_t.
const UniqueIDBytes = 128

// UniqueID is an nvshmemx_uniqueid_t: the root PE's GetUniqueID, which every PE of the group
// passes to Init.
type UniqueID [UniqueIDBytes]byte

// uniqueIDVersion is the version field NVSHMEM's initializer puts first in an id: (1<<16)+size.
const uniqueIDVersion = 1<<16 + UniqueIDBytes

// Check says whether id looks like one GetUniqueID made: the version NVSHMEM writes first and
// some content after it. An id of the cpu backend (random bytes) or of zeros fails here rather
// than sending NVSHMEM's bootstrap to connect to whatever address the bytes spell.
func (id UniqueID) Check() error {
	if v := binary.LittleEndian.Uint32(id[:4]); v != uniqueIDVersion {
		return fmt.Errorf("pyep: nvshmem: not an NVSHMEM unique id (version field %#x, expected %#x)", v, uniqueIDVersion)
	}
	for _, b := range id[4:] {
		if b != 0 {
			return nil
		}
	}
	return errors.New("pyep: nvshmem: not an NVSHMEM unique id (empty)")
}

// Version is NVSHMEM's vendor version, e.g. 3.7.2.
type Version struct{ Major, Minor, Patch int }

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Patch) }

// Install is where an installation's files are, found beside the host library that was loaded.
type Install struct {
	// LibDir holds the host library, the bootstrap and transport plugins (which NVSHMEM finds
	// through the host library's RPATH, $ORIGIN) and the device library.
	LibDir string
	// DeviceLibrary is LibDir's libnvshmem_device.a, the device code nvJitLink links a kernel
	// with; "" if the installation has none (a runtime-only package).
	DeviceLibrary string
	// IncludeDir holds nvshmem.h, for NVRTC's -I; "" if the installation has none.
	IncludeDir string
}

// installOf reads the installation around the host library at path.
func installOf(path string) Install {
	in := Install{LibDir: filepath.Dir(path)}
	if dev := filepath.Join(in.LibDir, "libnvshmem_device.a"); isFile(dev) {
		in.DeviceLibrary = dev
	}
	if inc := filepath.Join(filepath.Dir(in.LibDir), "include"); isFile(filepath.Join(inc, "nvshmem.h")) {
		in.IncludeDir = inc
	}
	return in
}

// DeviceLink is what compiling and linking a kernel against NVSHMEM needs of the installation:
// its include directory and its device library, or an error saying which is missing.
func (in Install) DeviceLink() (includeDir, deviceLibrary string, err error) {
	if in.IncludeDir == "" || in.DeviceLibrary == "" {
		return "", "", fmt.Errorf("pyep: nvshmem: the installation at %s lacks its headers (../include/nvshmem.h) or "+
			"its device library (libnvshmem_device.a), which NVSHMEM kernels are compiled and linked against; "+
			"the nvidia-nvshmem-cu12/-cu13 wheels have both, or point %s at a full installation", in.LibDir, DirEnv)
	}
	return in.IncludeDir, in.DeviceLibrary, nil
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

// nvidiaLibDirs are where NVIDIA's wheels put NVSHMEM in a site-packages directory:
// nvidia-nvshmem-cu12 and -cu13 both install nvidia/nvshmem.
var nvidiaLibDirs = []string{"nvidia/nvshmem/lib"}

// Candidates lists where Open looks for the host library, in order, as read through getenv:
//
//  1. $NVSHMEM_DIR/lib. When NVSHMEM_DIR is set its library is the only candidate: whoever sets
//     it wants that installation, and silently loading another one would hide the mistake.
//  2. nvidia/nvshmem/lib in each Python site-packages directory (dl.SitePackages): the wheel
//     that PyTorch installs.
//  3. The bare soname, libnvshmem_host.so.3, for the dynamic loader's own search
//     (LD_LIBRARY_PATH, ldconfig).
//
// Files of steps 1 and 2 are listed only if they exist (step 1 lists its directory's expected
// file even if absent, so the error names it).
func Candidates(getenv func(string) string) []string {
	if dir := getenv(DirEnv); dir != "" {
		lib := filepath.Join(dir, "lib")
		if found := libraries(lib); len(found) > 0 {
			return found
		}
		return []string{filepath.Join(lib, hostLibrary+".3")}
	}
	var out []string
	seen := map[string]bool{}
	for _, sp := range dl.SitePackages(getenv) {
		for _, d := range nvidiaLibDirs {
			for _, m := range libraries(filepath.Join(sp, d)) {
				if !seen[m] {
					seen[m] = true
					out = append(out, m)
				}
			}
		}
	}
	return append(out, hostLibrary+".3")
}

// libraries are dir's libnvshmem_host.so*, the longest version suffix first (in practice links
// to one file).
func libraries(dir string) []string {
	matches, _ := filepath.Glob(filepath.Join(dir, hostLibrary+"*"))
	sort.Sort(sort.Reverse(sort.StringSlice(matches)))
	return matches
}

// NotFoundError says that no candidate could be loaded, and why each one failed.
type NotFoundError struct {
	Tried []string // "candidate (reason)", in search order
}

func (e *NotFoundError) Error() string {
	return "pyep: cannot find NVSHMEM, which low-latency mode across nodes needs (searched $" + DirEnv +
		"/lib, nvidia/nvshmem/lib under the Python site-packages (PYEP_SITE_PACKAGES, $VIRTUAL_ENV, $CONDA_PREFIX) " +
		"and the loader's path); tried " + strings.Join(e.Tried, ", ") +
		". Install it with `pip install nvidia-nvshmem-cu12` (or -cu13, to match PyTorch's CUDA) or set " +
		DirEnv + " to an NVSHMEM installation"
}

// ErrNotInitialized is a call that needs an initialised NVSHMEM before Init (or after Finalize).
var ErrNotInitialized = errors.New("pyep: nvshmem: not initialised (Init first)")

// Error is a call that NVSHMEM failed, with its status. The binding's errors wrap it in what was
// being done.
type Error struct {
	Op     string // the entry point, e.g. "nvshmemx_hostlib_init_attr"
	Status int
}

// statusNames are nvshmemx_status's names (non_abi/nvshmemx_error.h), by value.
var statusNames = []string{
	"NVSHMEMX_SUCCESS", "NVSHMEMX_ERROR_INVALID_VALUE", "NVSHMEMX_ERROR_OUT_OF_MEMORY",
	"NVSHMEMX_ERROR_NOT_SUPPORTED", "NVSHMEMX_ERROR_SYMMETRY", "NVSHMEMX_ERROR_GPU_NOT_SELECTED",
	"NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED", "NVSHMEMX_ERROR_INTERNAL",
}

func (e *Error) Error() string {
	name := fmt.Sprintf("status %d", e.Status)
	if e.Status >= 0 && e.Status < len(statusNames) {
		name = fmt.Sprintf("%s (%d)", statusNames[e.Status], e.Status)
	}
	return fmt.Sprintf("%s failed: %s (NVSHMEM's own message, if any, is on stderr; NVSHMEM_DEBUG=INFO says more)", e.Op, name)
}

// Group is this process's place in an NVSHMEM job bootstrapped from one unique id.
type Group struct {
	ID    UniqueID // the root's GetUniqueID, the same on every PE
	Rank  int      // this process's PE, in [0, Ranks)
	Ranks int
	// Device is the CUDA device NVSHMEM runs on; -1 leaves it to NVSHMEM (the device current on
	// the calling OS thread).
	Device int
}

func (g Group) check() error {
	if g.Ranks < 1 || g.Rank < 0 || g.Rank >= g.Ranks {
		return fmt.Errorf("pyep: nvshmem: rank %d of %d: expected 0 <= rank < ranks", g.Rank, g.Ranks)
	}
	if g.Device < -1 {
		return fmt.Errorf("pyep: nvshmem: device %d: expected a device ordinal or -1", g.Device)
	}
	return g.ID.Check()
}

// Library is the loaded host library and this process's NVSHMEM state. There is one per process
// (Open). Its methods are safe for concurrent use, but NVSHMEM's collectives (Init, Malloc, Free,
// BarrierAll, Finalize) must be called by every PE in the same order, and by one goroutine at a
// time in each process: NVSHMEM is initialised for serialised threads.
type Library struct {
	// Path is the file the dynamic loader mapped.
	Path    string
	Version Version
	Install Install

	mu        sync.RWMutex
	initDone  bool
	pe, npes  int
	heap      map[uintptr]int // what Malloc returned and is not yet freed: the sizes
	heapBytes int
}

var (
	openOnce sync.Once
	theLib   *Library
	openErr  error
)

// errNoCgo is what a build without cgo (hence without dlopen) answers.
var errNoCgo = errors.New("pyep: this build of pyep has no cgo, so it cannot load NVSHMEM; rebuild with CGO_ENABLED=1")

// Open loads the host library on first use, from Candidates read from the environment then
// (the C library's, which Python's os.environ writes); later calls return the same result.
func Open() (*Library, error) {
	openOnce.Do(func() { theLib, openErr = load(Candidates(env.Get)) })
	return theLib, openErr
}

// Initialized says whether Init succeeded and Finalize has not run since.
func (l *Library) Initialized() bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.initDone
}

// MyPE and NPEs are this process's PE and the group's size, as NVSHMEM reported them at Init.
func (l *Library) MyPE() (int, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if !l.initDone {
		return 0, ErrNotInitialized
	}
	return l.pe, nil
}

// NPEs: see MyPE.
func (l *Library) NPEs() (int, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if !l.initDone {
		return 0, ErrNotInitialized
	}
	return l.npes, nil
}

// HeapBytes is what Malloc handed out and Free has not yet taken back.
func (l *Library) HeapBytes() int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.heapBytes
}
