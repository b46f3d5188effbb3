package cuda

import (
	"fmt"
	"strconv"
	"sync"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/env"
	"github.com/pyep/pyep/goep/jit"
)

// The kernels of normal mode, compiled once per device and shared by every buffer's engine.

// KernelLoader provides the kernels; the default compiles with NVRTC. file is a kernel source
// ("intranode.cu"), kernel the entry point, defines the constants it is specialised on.
type KernelLoader interface {
	Load(b *Backend, file, kernel string, defines map[string]string) (driver.Function, error)
}

// NormalOptions tune the normal-mode engines of a device; tests set them (SetNormalOptions), the
// zero value is the default.
type NormalOptions struct {
	Loader KernelLoader // nil: NVRTC for the device's architecture
	// Block sizes of dispatch/combine, notify and layout; 0: 768 (PYEP_NORMAL_THREADS, a
	// multiple of 32 up to 1024, read at start-up, overrides it), 1024, 512.
	Threads, NotifyThreads, LayoutThreads int
	// Low-latency mode's block size (0: 512) and blocks (0: one an SM, at most 32, shared among
	// the ranks on the GPU).
	LowLatencyThreads, LowLatencyBlocks int
}

// normalThreads is the block size of dispatch and combine: PYEP_NORMAL_THREADS when valid.
var normalThreads = env.Threads(768)

func (o NormalOptions) withDefaults() NormalOptions {
	if o.Threads == 0 {
		o.Threads = normalThreads
	}
	if o.NotifyThreads == 0 {
		o.NotifyThreads = 1024
	}
	if o.LayoutThreads == 0 {
		o.LayoutThreads = 512
	}
	if o.LowLatencyThreads == 0 {
		o.LowLatencyThreads = 512
	}
	return o
}

// extraFlags are further NVRTC options for every kernel, from PYEP_JIT_FLAGS (space-separated,
// e.g. "-lineinfo" for compute-sanitizer's source lines).
var extraFlags = env.Flags()

// debugSync (PYEP_DEBUG_SYNC=1, a debugging aid) makes every launch wait for its kernel and
// name the kernel that failed.
var debugSync = env.Sync()

// kernelCache is a device's loaded kernels (its zero value is ready): modules live in the
// device's primary context, so every buffer's engine on the device shares them.
type kernelCache struct {
	mu      sync.Mutex
	set     bool // opts were set
	opts    NormalOptions
	arch    string
	kernels map[kernelKey]driver.Function
	sources map[string]jit.Source
}

// SetNormalOptions replaces the device's engine options and forgets the kernels loaded so far.
func (b *Backend) SetNormalOptions(o NormalOptions) {
	k := &b.kernels
	k.mu.Lock()
	defer k.mu.Unlock()
	k.opts, k.set = o.withDefaults(), true
	k.kernels = nil
}

// options are the device's engine options.
func (k *kernelCache) options() NormalOptions {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.set {
		k.opts, k.set = NormalOptions{}.withDefaults(), true
	}
	return k.opts
}

const (
	kindNotify = iota + 1
	kindDispatch
	kindCombine
	kindLayout
	kindLLDispatch
	kindLLCombine
)

// kernelKey identifies a compiled variant; comparable, so a lookup allocates nothing.
type kernelKey struct {
	kind, name                 int8
	ranks, a, b, c, d, threads int32
}

const (
	nameNotify = iota + 1
	namePrologue
	nameDispatch
	nameCombine
	nameLayout
	nameLLDispatch
	nameLLCombine
)

// kernelSymbol is where a kernel lives and the symbols it is loaded by.
type kernelSymbol struct {
	file string // in kernels/
	c    string // the emulator's extern "C" twin, and the name in errors
	gpu  string // in the GPU image: the C name, or the mangled C++ name of pyep::ll::dispatch(pyep::pyep_ll_params) and
	// ::combine, which profilers show and DeepEP's test harness looks for (see low_latency.cu)
}

var kernelSymbols = map[int8]kernelSymbol{
	nameNotify:     {"intranode.cu", "pyep_notify", "pyep_notify"},
	namePrologue:   {"intranode.cu", "pyep_prologue", "pyep_prologue"},
	nameDispatch:   {"intranode.cu", "pyep_dispatch", "pyep_dispatch"},
	nameCombine:    {"intranode.cu", "pyep_combine", "pyep_combine"},
	nameLayout:     {"layout.cu", "pyep_layout", "pyep_layout"},
	nameLLDispatch: {"low_latency.cu", "pyep_ll_dispatch", "_ZN4pyep2ll8dispatchENS_14pyep_ll_paramsE"},
	nameLLCombine:  {"low_latency.cu", "pyep_ll_combine", "_ZN4pyep2ll7combineENS_14pyep_ll_paramsE"},
}

// GPUSymbols are the symbols the GPU loads, by kernel file (for tests that check them against the compiled image).
func GPUSymbols() map[string][]string {
	out := map[string][]string{}
	for _, sym := range kernelSymbols {
		out[sym.file] = append(out[sym.file], sym.gpu)
	}
	return out
}

// function returns the kernel of key, loading it on first use; the context is current.
func (k *kernelCache) function(b *Backend, key kernelKey, defines func() map[string]string) (driver.Function, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if f, ok := k.kernels[key]; ok {
		return f, nil
	}
	sym := kernelSymbols[key.name]
	var f driver.Function
	var err error
	if k.opts.Loader != nil {
		f, err = k.opts.Loader.Load(b, sym.file, sym.c, defines())
	} else {
		f, err = k.nvrtc(b, sym.file, sym.gpu, defines())
	}
	if err != nil {
		return driver.Function{}, fmt.Errorf("pyep: loading kernel %s of %s: %w", sym.c, sym.file, err)
	}
	if k.kernels == nil {
		k.kernels = map[kernelKey]driver.Function{}
	}
	k.kernels[key] = f
	return f, nil
}

// nvrtc compiles file for this GPU (through jit's cache) and loads the kernel.
func (k *kernelCache) nvrtc(b *Backend, file, name string, defines map[string]string) (driver.Function, error) {
	if k.arch == "" {
		arch, err := b.dev.Arch()
		if err != nil {
			return driver.Function{}, err
		}
		k.arch = arch
	}
	src, ok := k.sources[file]
	if !ok {
		var err error
		if src, err = jit.Kernel(file); err != nil {
			return driver.Function{}, err
		}
		if k.sources == nil {
			k.sources = map[string]jit.Source{}
		}
		k.sources[file] = src
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

func itoa(n int) string { return strconv.Itoa(n) }

// The constants each kernel variant is compiled with (the engine's choices; exported for tools
// that fill the kernel cache ahead of time).

// LayoutDefines are layout.cu's for blocks of threads.
func LayoutDefines(threads int) map[string]string {
	return map[string]string{"PYEP_LAYOUT_THREADS": itoa(threads), "PYEP_LAYOUT_EXPERTS_PER_BLOCK": itoa(layoutExpertsPerBlock)}
}

// NotifyDefines are those of notify and the prologue (intranode.cu) for numRanks ranks.
func NotifyDefines(numRanks, notifyThreads, threads int) map[string]string {
	return map[string]string{"PYEP_NOTIFY": "", "PYEP_RANKS": itoa(numRanks), "PYEP_NOTIFY_THREADS": itoa(notifyThreads),
		"PYEP_THREADS": itoa(threads)}
}

// DispatchDefines are the dispatch kernel's: rows of hiddenBytes (+ scalesBytes of scales),
// topk indices per token (0 for a cached dispatch), moved as vec-byte vectors.
func DispatchDefines(numRanks, hiddenBytes, scalesBytes, topk, vec, threads int) map[string]string {
	return map[string]string{"PYEP_DISPATCH": "", "PYEP_RANKS": itoa(numRanks), "PYEP_HIDDEN_BYTES": itoa(hiddenBytes),
		"PYEP_SCALES_BYTES": itoa(scalesBytes), "PYEP_TOPK": itoa(topk), "PYEP_VEC": itoa(vec), "PYEP_THREADS": itoa(threads)}
}

// CombineDefines are the combine kernel's: rows of hidden elements of dtype (1 bf16, 2 fp16,
// 3 fp32), topk weights per row (0 for none), vec-byte vectors.
func CombineDefines(numRanks, hidden, dtype, topk, vec, threads int) map[string]string {
	return map[string]string{"PYEP_COMBINE": "", "PYEP_RANKS": itoa(numRanks), "PYEP_HIDDEN": itoa(hidden),
		"PYEP_DTYPE": itoa(dtype), "PYEP_TOPK": itoa(topk), "PYEP_VEC": itoa(vec), "PYEP_THREADS": itoa(threads)}
}

const layoutExpertsPerBlock = 64
