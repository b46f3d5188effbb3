//go:build cgo

// Package emu runs pyep's CUDA kernels (kernels/*.cu, compiled as C++ against emu.h) on the
// host, under goep/cuda's fake driver, so that the engines (goep/cuda/normal,
// goep/cuda/lowlatency) and their kernels are tested end to end on machines without a GPU:
// every CUDA thread is an OS thread, every fake rank a goroutine with its own Backend.
//
// The kernels are built when first launched, as on a GPU: goep/jit compiles the embedded
// source with the engine's defines (any shape) with the host C++ compiler into a shared
// object, under the cache key discipline of its NVRTC builds (an edited kernel, emu.h or
// launch.h is a new key), and keeps it in its cache directory for later runs.
//
// A launch runs all its blocks at once, unless PYEP_EMU_RESIDENT_BLOCKS=n: then at most n at a
// time, started in block order as earlier ones end, as on a GPU (or an MPS client's share of
// one) with room for fewer blocks than the grid. A kernel whose blocks wait for a later block of
// their own launch hangs there (until its wait times out), as it would on the GPU.
package emu

/*
#include <stdlib.h>

// The library's exports (launch.h and the wrapper), called through the addresses dlsym gave.
typedef const void* (*emu_kernel_fn)(const char* name, const char** why);
typedef int (*emu_launch_fn)(const void* kernel, unsigned grid, unsigned block, const void* params);

static const void* emu_call_kernel(void* f, const char* name, const char** why) {
	return ((emu_kernel_fn)f)(name, why);
}
static int emu_call_launch(void* f, const void* kernel, unsigned grid, unsigned block, const void* params) {
	return ((emu_launch_fn)f)(kernel, grid, block, params);
}
*/
import "C"

import (
	_ "embed"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"unsafe"

	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
	"github.com/pyep/pyep/goep/jit"
)

var (
	//go:embed emu.h
	emuH string
	//go:embed launch.h
	launchH string
	//go:embed remote.h
	remoteH string
)

// Options are the engine options that run the emulated kernels: small blocks, since every
// thread is an OS thread.
func Options() cuda.NormalOptions {
	return cuda.NormalOptions{Loader: Loader{}, Threads: 128, NotifyThreads: 64, LayoutThreads: 64}
}

// Options4 are Options for four ranks, which need five warps a block (one per rank and the
// publisher).
func Options4() cuda.NormalOptions {
	o := Options()
	o.Threads = 160
	return o
}

// OptionsGPU are Options with the GPU's shapes of dispatch and combine (each op's block size and
// copy unroll for the rank count, cudanormal.ShapeFor).
func OptionsGPU() cuda.NormalOptions {
	o := Options()
	o.Threads = 0
	return o
}

// Loader is a cuda.KernelLoader for Backends over a fake driver.
type Loader struct{}

// Load implements cuda.KernelLoader: it builds file with defines for the host (or finds it
// built) and registers kernel with the backend's fake world.
func (Loader) Load(b *cuda.Backend, file, kernel string, defines map[string]string) (driver.Function, error) {
	d, ok := b.Driver().(*fake.Driver)
	if !ok {
		return driver.Function{}, fmt.Errorf("emu: the backend's driver is not a fake driver")
	}
	lib, err := build(file, defines)
	if err != nil {
		return driver.Function{}, err
	}
	cname := C.CString(kernel)
	defer C.free(unsafe.Pointer(cname))
	var why *C.char
	k := C.emu_call_kernel(lib.kernel, cname, &why)
	if k == nil {
		reason := "it is not an entry point of the source"
		if why != nil {
			reason = C.GoString(why)
		}
		return driver.Function{}, fmt.Errorf("emu: %s of %s cannot run: %s", kernel, file, reason)
	}
	name := "emu:" + lib.Key[:16] + ":" + kernel
	d.World().RegisterKernel(name, func(l *fake.Launch) error {
		if l.Grid[1] != 1 || l.Grid[2] != 1 || l.Block[1] != 1 || l.Block[2] != 1 {
			return fmt.Errorf("emu: one-dimensional launches only")
		}
		switch rc := C.emu_call_launch(lib.launch, k, C.uint(l.Grid[0]), C.uint(l.Block[0]), l.Args[0]); rc {
		case 0:
		case -2:
			return fmt.Errorf("emu: %s ended with remote puts that no signal followed (pyep internal error: a receiver would wait for them)", l.Name)
		default:
			return fmt.Errorf("emu: could not start the threads of %s", l.Name)
		}
		return nil
	})
	mod, err := d.ModuleLoadData([]byte{1})
	if err != nil {
		return driver.Function{}, err
	}
	return mod.Function(name)
}

// library is a kernel source built for the host, with its two exports.
type library struct {
	*jit.Library
	kernel, launch unsafe.Pointer // emu_kernel, emu_launch
}

var (
	mu        sync.Mutex
	sources   = map[string]jit.Source{}
	libraries = map[string]*library{}
)

// build returns file built with defines.
func build(file string, defines map[string]string) (*library, error) {
	mu.Lock()
	src, ok := sources[file]
	mu.Unlock()
	if !ok {
		var err error
		if src, err = wrap(file); err != nil {
			return nil, err
		}
		mu.Lock()
		sources[file] = src
		mu.Unlock()
	}
	lib, err := jit.CompileHost(src, jit.HostOptions{Defines: defines})
	if err != nil {
		return nil, fmt.Errorf("emu: building %s for the host: %w", file, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if l, ok := libraries[lib.Key]; ok {
		return l, nil
	}
	l := &library{Library: lib}
	if l.kernel, err = lib.Symbol("emu_kernel"); err != nil {
		return nil, err
	}
	if l.launch, err = lib.Symbol("emu_launch"); err != nil {
		return nil, err
	}
	libraries[lib.Key] = l
	return l, nil
}

// entryRE finds a kernel file's entry points: extern "C" __global__ void [__launch_bounds__(...)] name(.
var entryRE = regexp.MustCompile(`(?m)^[ \t]*extern[ \t]+"C"[ \t]+__global__[ \t]+void[ \t]+(?:__launch_bounds__\([^)]*\)[ \t]+)?([A-Za-z_][A-Za-z0-9_]*)[ \t]*\(`)

// wrap is the translation unit that the host compiler builds for file: the kernel source under
// PYEP_EMU (so it includes emu.h instead of utils.cuh), the launcher, and emu_kernel, which
// finds an entry point by name. Which entry points a build has depends on its defines (notify
// under PYEP_NOTIFY, ...), so every one the source declares is listed, and
// one that the defines leave out resolves to an emu::Absent object instead: the kernels live
// in namespace pyep, which unqualified lookup searches before the global namespace, where the
// using-directive puts the stand-ins.
func wrap(file string) (jit.Source, error) {
	k, err := jit.Kernel(file)
	if err != nil {
		return jit.Source{}, err
	}
	var names []string
	for _, m := range entryRE.FindAllStringSubmatch(k.Text, -1) {
		names = append(names, m[1])
	}
	var b strings.Builder
	fmt.Fprintf(&b, "// The emulator's build of %s (goep/cuda/emu): the kernels, the launcher, and the table of entry points.\n", k.Name)
	fmt.Fprintf(&b, "#define PYEP_EMU\n#include %q\n#include \"launch.h\"\n\nnamespace emu_absent {\n", file)
	for _, n := range names {
		fmt.Fprintf(&b, "const ::emu::Absent %s{};\n", n)
	}
	b.WriteString("}  // namespace emu_absent\n\nnamespace pyep {\n")
	b.WriteString("extern \"C\" __attribute__((visibility(\"default\"))) const ::emu::Kernel* emu_kernel(const char* name, const char** why) {\n")
	b.WriteString("    using namespace ::emu_absent;\n    static const ::emu::Kernel table[] = {\n")
	for _, n := range names {
		fmt.Fprintf(&b, "        ::emu::kernel(%q, %s),\n", n, n)
	}
	b.WriteString("    };\n    for (const ::emu::Kernel& k : table) {\n        if (std::strcmp(k.name, name) != 0) continue;\n")
	b.WriteString("        if (k.fn == nullptr) *why = k.why;\n        return k.fn != nullptr ? &k : nullptr;\n    }\n")
	b.WriteString("    return nullptr;\n}\n}  // namespace pyep\n")
	headers := append(append([]jit.Header{}, k.Headers...),
		jit.Header{Name: file, Text: k.Text}, jit.Header{Name: "emu.h", Text: emuH}, jit.Header{Name: "launch.h", Text: launchH},
		jit.Header{Name: "remote.h", Text: remoteH})
	return jit.Source{Name: "emu/" + strings.TrimSuffix(file, ".cu") + ".cc", Text: b.String(), Headers: headers}, nil
}

// symmetricTag is remote.h's kSymmetricTag: a remote peer's region is named to the emulated
// kernels by its mapping plus the tag, an address that faults if a kernel writes to it directly.
const symmetricTag = 1 << 62

// RemoteName is what names region, a remote peer's region as mapped here, to the emulated
// kernels' remote_put (cudall.Reach's Names): the emulator's stand-in for NVSHMEM's symmetric
// address, which the kernels may only pass to remote.cuh.
func RemoteName(region unsafe.Pointer) uint64 { return uint64(uintptr(region)) + symmetricTag }
