package cuda

import (
	"fmt"
	"sync"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/env"
	"github.com/pyep/pyep/goep/jit"
	"github.com/pyep/pyep/goep/nvshmem"
)

// The device's compiled kernels, of every mode: compiled once per device and shared by every
// buffer's engines (goep/cuda/normal, goep/cuda/lowlatency), which look them up by KernelKey.

// KernelLoader provides the kernels; the default compiles with NVRTC. file is a kernel source
// ("intranode.cu"), kernel the entry point, defines the constants it is specialised on.
type KernelLoader interface {
	Load(b *Backend, file, kernel string, defines map[string]string) (driver.Function, error)
}

// NormalOptions tune the engines of a device, of normal and low-latency mode; tests set them
// (SetNormalOptions), the zero value is the default.
type NormalOptions struct {
	Loader KernelLoader // nil: NVRTC for the device's architecture
	// Block size and copy unroll of dispatch and combine, for every op where not 0; 0: each op's
	// own for the rank count (cudanormal.ShapeFor). PYEP_NORMAL_THREADS (a multiple of 32 up to
	// 1024) and PYEP_COPY_UNROLL (1 to 16), read at start-up, set them.
	Threads, Unroll int
	// Block sizes of notify and layout; 0: 1024, 128 (a layout of 4096 tokens then runs on 32 SMs).
	NotifyThreads, LayoutThreads int
	// Low-latency mode's block size (0: 512) and blocks (0: one an SM, shared among the ranks on
	// the GPU).
	LowLatencyThreads, LowLatencyBlocks int
}

// normalThreads and normalUnroll are PYEP_NORMAL_THREADS and PYEP_COPY_UNROLL when valid, else 0.
var normalThreads, normalUnroll = env.Threads(0), env.Unroll()

func (o NormalOptions) withDefaults() NormalOptions {
	if o.Threads == 0 {
		o.Threads = normalThreads
	}
	if o.Unroll == 0 {
		o.Unroll = normalUnroll
	}
	if o.NotifyThreads == 0 {
		o.NotifyThreads = 1024
	}
	if o.LayoutThreads == 0 {
		o.LayoutThreads = 128
	}
	if o.LowLatencyThreads == 0 {
		o.LowLatencyThreads = 512
	}
	return o
}

// extraFlags are further NVRTC options for every kernel, from PYEP_JIT_FLAGS as set when the core
// is loaded (space-separated, e.g. "-lineinfo" for compute-sanitizer's source lines).
var extraFlags = env.Flags()

// kernelCache is a device's loaded kernels (its zero value is ready): modules live in the
// device's primary context, so every buffer's engine on the device shares them.
type kernelCache struct {
	mu      sync.Mutex
	set     bool // opts were set
	opts    NormalOptions
	arch    string
	kernels map[KernelKey]driver.Function
	sources map[string]jit.Source
}

// RemoteDefine is the define of a low-latency kernel that reaches peers on other nodes through
// kernels/remote.cuh: on a GPU it is compiled to LTO-IR, linked with NVSHMEM's device library
// (goep/jit's CompileLinked) and registered with NVSHMEM (nvshmemx_cumodule_init) before its
// first launch, which needs NVSHMEM initialised (the buffer's sync does it).
const RemoteDefine = "PYEP_LL_REMOTE"

// SetNormalOptions replaces the device's engine options and forgets the kernels loaded so far.
func (b *Backend) SetNormalOptions(o NormalOptions) {
	k := &b.kernels
	k.mu.Lock()
	defer k.mu.Unlock()
	k.opts, k.set = o.withDefaults(), true
	k.kernels = nil
}

// NormalOptions are the device's engine options (SetNormalOptions; the defaults until then),
// which an engine takes at the start of every call.
func (b *Backend) NormalOptions() NormalOptions { return b.kernels.options() }

// options are the device's engine options.
func (k *kernelCache) options() NormalOptions {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.set {
		k.opts, k.set = NormalOptions{}.withDefaults(), true
	}
	return k.opts
}

// Kernel names an entry point of kernels/: its file and its symbols (kernelSymbols).
type Kernel int8

// The entry points of every mode.
const (
	KernelNotify Kernel = iota + 1
	KernelDispatch
	KernelNotifyDispatch // the queued dispatch: notify and dispatch in one kernel
	KernelCombine
	KernelLayout
	KernelLLDispatch
	KernelLLCombine
)

// KernelKey identifies a compiled variant: the kernel and the numbers its engine specialises it
// on (ranks, shape, block size, copy unroll; A to E as the engine uses them), which also make its
// defines. Comparable, so a lookup allocates nothing.
type KernelKey struct {
	Kernel                                Kernel
	Ranks, A, B, C, D, E, Threads, Unroll int32
}

// kernelSymbol is where a kernel lives and the symbols it is loaded by.
type kernelSymbol struct {
	file string // in kernels/
	c    string // the emulator's extern "C" twin, and the name in errors
	gpu  string // in the GPU image: the C name, or the mangled C++ name of pyep::ll::dispatch(pyep::pyep_ll_params) and
	// ::combine, which profilers show and DeepEP's test harness looks for (see low_latency.cu)
}

var kernelSymbols = map[Kernel]kernelSymbol{
	KernelNotify:         {"intranode.cu", "pyep_notify", "pyep_notify"},
	KernelDispatch:       {"intranode.cu", "pyep_dispatch", "pyep_dispatch"},
	KernelNotifyDispatch: {"intranode.cu", "pyep_notify_dispatch", "pyep_notify_dispatch"},
	KernelCombine:        {"intranode.cu", "pyep_combine", "pyep_combine"},
	KernelLayout:         {"layout.cu", "pyep_layout", "pyep_layout"},
	KernelLLDispatch:     {"low_latency.cu", "pyep_ll_dispatch", "_ZN4pyep2ll8dispatchENS_14pyep_ll_paramsE"},
	KernelLLCombine:      {"low_latency.cu", "pyep_ll_combine", "_ZN4pyep2ll7combineENS_14pyep_ll_paramsE"},
}

// GPUSymbols are the symbols the GPU loads, by kernel file (for tests that check them against the compiled image).
func GPUSymbols() map[string][]string {
	out := map[string][]string{}
	for _, sym := range kernelSymbols {
		out[sym.file] = append(out[sym.file], sym.gpu)
	}
	return out
}

// Kernel returns the compiled variant key of a kernel, compiling and loading it on first use
// (through the options' Loader, or NVRTC for this GPU) with the constants defines returns, which
// it calls only then. The context must be current (Enter).
func (b *Backend) Kernel(key KernelKey, defines func() map[string]string) (driver.Function, error) {
	return b.kernels.function(b, key, defines)
}

// function returns the kernel of key, loading it on first use; the context is current.
func (k *kernelCache) function(b *Backend, key KernelKey, defines func() map[string]string) (driver.Function, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if f, ok := k.kernels[key]; ok {
		return f, nil
	}
	sym := kernelSymbols[key.Kernel]
	var f driver.Function
	var err error
	d := defines()
	_, remote := d[RemoteDefine]
	switch {
	case k.opts.Loader != nil:
		f, err = k.opts.Loader.Load(b, sym.file, sym.c, d)
	case remote:
		f, err = k.linkedKernel(b, key, sym.file, sym.gpu, d)
	default:
		f, err = k.nvrtc(b, sym.file, sym.gpu, d)
	}
	if err != nil {
		return driver.Function{}, fmt.Errorf("pyep: loading kernel %s of %s: %w", sym.c, sym.file, err)
	}
	if k.kernels == nil {
		k.kernels = map[KernelKey]driver.Function{}
	}
	k.kernels[key] = f
	return f, nil
}

// source is file's source and the device's architecture.
func (k *kernelCache) source(b *Backend, file string) (jit.Source, error) {
	if k.arch == "" {
		arch, err := b.dev.Arch()
		if err != nil {
			return jit.Source{}, err
		}
		k.arch = arch
	}
	src, ok := k.sources[file]
	if !ok {
		var err error
		if src, err = jit.Kernel(file); err != nil {
			return jit.Source{}, err
		}
		if k.sources == nil {
			k.sources = map[string]jit.Source{}
		}
		k.sources[file] = src
	}
	return src, nil
}

// nvrtc compiles file for this GPU (through jit's cache) and loads the kernel.
func (k *kernelCache) nvrtc(b *Backend, file, name string, defines map[string]string) (driver.Function, error) {
	src, err := k.source(b, file)
	if err != nil {
		return driver.Function{}, err
	}
	cubin, err := jit.Compile(src, jit.Options{Arch: k.arch, Defines: defines, Flags: extraFlags})
	if err != nil {
		return driver.Function{}, err
	}
	mod, err := b.drv.ModuleLoadData(cubin)
	if err != nil {
		return driver.Function{}, err
	}
	return mod.Function(name)
}

// linkedKernel compiles file with NVSHMEM (RemoteDefine), links it with NVSHMEM's device library,
// loads it, and registers the module with NVSHMEM, which must be initialised.
func (k *kernelCache) linkedKernel(b *Backend, key KernelKey, file, name string, defines map[string]string) (driver.Function, error) {
	lib, err := nvshmem.Open()
	if err != nil {
		return driver.Function{}, err
	}
	if !lib.Initialized() {
		return driver.Function{}, fmt.Errorf("%s needs NVSHMEM initialised, which the buffer's sync does for a group across nodes: %w",
			RemoteDefine, nvshmem.ErrNotInitialized)
	}
	inc, dev, err := lib.Install.DeviceLink()
	if err != nil {
		return driver.Function{}, err
	}
	src, err := k.source(b, file)
	if err != nil {
		return driver.Function{}, err
	}
	cubin, err := jit.CompileLinked(src, jit.LinkOptions{Options: jit.Options{Arch: k.arch, Defines: defines, Flags: extraFlags},
		IncludeDirs: []string{inc}, Libraries: []string{dev}})
	if err != nil {
		return driver.Function{}, err
	}
	mod, err := b.drv.ModuleLoadData(cubin)
	if err != nil {
		return driver.Function{}, err
	}
	if err := lib.ModuleInit(mod.Raw()); err != nil {
		_ = b.drv.ModuleUnload(mod)
		return driver.Function{}, err
	}
	return mod.Function(name)
}
