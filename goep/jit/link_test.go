package jit

import (
	"bytes"
	"debug/elf"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/dl/dltest"
	"github.com/pyep/pyep/goep/nvshmem"
)

// The key of a compile without files is the one this recipe made before linking existed: the
// kernels cached on disk stay valid.
func TestCacheKeyUnchangedWithoutFiles(t *testing.T) {
	in := keyInput{compiler: "13.2", output: "false", flags: []string{"--gpu-architecture=sm_90", "-std=c++17", "-DA=1"},
		src: Source{Name: "kernels/x.cu", Text: "__global__ void k() {}", Headers: []Header{{Name: "h.cuh", Text: "// h"}}}}
	assert.Equal(t, "5b97b1d19f0002f8074e7b231e5b451f2d8347d961e9ce83ffa59d51291a0fad", cacheKey(in))
	in.files = []string{"library x"}
	assert.NotEqual(t, "5b97b1d19f0002f8074e7b231e5b451f2d8347d961e9ce83ffa59d51291a0fad", cacheKey(in))
}

// requireNVJitLink skips (never fails) where NVRTC or nvJitLink is absent, saying why.
func requireNVJitLink(t *testing.T) *NVJitLink {
	t.Helper()
	requireNVRTC(t)
	jl, err := LoadNVJitLink()
	var nf *JitLinkNotFoundError
	if errors.As(err, &nf) || errors.Is(err, errNoCgo) {
		t.Skipf("nvJitLink not found, so nothing can be linked here: %v", err)
	}
	require.NoError(t, err)
	t.Logf("nvJitLink %d.%d from %s", jl.Major, jl.Minor, jl.Path)
	return jl
}

// requireNVSHMEMDevice skips where no NVSHMEM installation with headers and a device library is
// found, and returns its include directory and device library.
func requireNVSHMEMDevice(t *testing.T) (includeDir, deviceLibrary string) {
	t.Helper()
	lib, err := nvshmem.Open()
	if err != nil {
		t.Skipf("NVSHMEM not found: %v", err)
	}
	inc, dev, err := lib.Install.DeviceLink()
	if err != nil {
		t.Skipf("NVSHMEM %s at %s cannot link device code: %v", lib.Version, lib.Path, err)
	}
	t.Logf("NVSHMEM %s: %s, %s", lib.Version, inc, dev)
	return inc, dev
}

func TestJitLinkCandidates(t *testing.T) {
	root := t.TempDir()
	touch := func(rel string) string { return dltest.Touch(t, root, rel) }
	beside := touch("cuda/lib64/libnvJitLink.so.12")
	wheel := touch("sp/nvidia/nvjitlink/lib/libnvJitLink.so.12")
	cu13 := touch("sp/nvidia/cu13/lib/libnvJitLink.so.13")
	got := JitLinkCandidates(func(k string) string {
		return map[string]string{"PYEP_SITE_PACKAGES": filepath.Join(root, "sp")}[k]
	}, filepath.Join(root, "cuda/lib64"))
	require.GreaterOrEqual(t, len(got), 5)
	assert.Equal(t, []string{beside, cu13, wheel}, got[:3])
	assert.Equal(t, []string{"libnvJitLink.so.13", "libnvJitLink.so.12"}, got[len(got)-2:])
}

func TestLoadNVJitLinkNotFound(t *testing.T) {
	_, err := loadNVJitLink([]string{"/nonexistent/libnvJitLink.so.13", "libc.so.6"}, nil)
	if errors.Is(err, errNoCgo) {
		t.Skip("built without cgo")
	}
	var nf *JitLinkNotFoundError
	require.ErrorAs(t, err, &nf)
	require.Len(t, nf.Tried, 2)
	assert.Contains(t, nf.Tried[1], "lacks nvJitLinkVersion")
	assert.Contains(t, err.Error(), "pip install nvidia-nvjitlink")
}

// NVRTC's include directories are found beside it in the wheels' and a toolkit's layouts.
func TestNVRTCIncludeDirs(t *testing.T) {
	root := t.TempDir()
	mk := func(rel string) string {
		p := filepath.Join(root, rel)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, nil, 0o644))
		return p
	}
	mk("cu13/include/cuda_runtime.h")
	mk("cu13/include/cccl/cuda/std/type_traits")
	mk("nvidia/cuda_runtime/include/cuda_runtime.h")
	mk("nvidia/cuda_cccl/include/cuda/std/type_traits")
	assert.Equal(t, []string{filepath.Join(root, "cu13/include"), filepath.Join(root, "cu13/include/cccl")},
		(&NVRTC{Path: filepath.Join(root, "cu13/lib/libnvrtc.so.13")}).IncludeDirs())
	assert.Equal(t, []string{filepath.Join(root, "nvidia/cuda_runtime/include"), filepath.Join(root, "nvidia/cuda_cccl/include")},
		(&NVRTC{Path: filepath.Join(root, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")}).IncludeDirs())
	assert.Empty(t, includeDirs(filepath.Join(root, "elsewhere"), nil))
	// PyTorch's nvidia/cu13 wheel without CCCL: cuda/std from the toolkit, cuda_runtime.h still the wheel's.
	mk("torch/cu13/include/cuda_runtime.h")
	mk("toolkit/include/cuda_runtime.h")
	mk("toolkit/include/cccl/cuda/std/type_traits")
	assert.Equal(t, []string{filepath.Join(root, "torch/cu13/include"), filepath.Join(root, "toolkit/include/cccl")},
		includeDirs(filepath.Join(root, "torch/cu13/lib"), []string{filepath.Join(root, "none"), filepath.Join(root, "toolkit")}))
}

// The probe kernel compiles to LTO-IR and links with libnvshmem_device.a into a cubin for
// sm_90 that carries the kernel and NVSHMEM's device state (what nvshmemx_cumodule_init fills);
// the cache answers it from memory, then from disk.
func TestCompileLinkedNVSHMEM(t *testing.T) {
	requireNVJitLink(t)
	inc, dev := requireNVSHMEMDevice(t)
	src, err := Kernel("nvshmem_probe.cu")
	require.NoError(t, err)
	opts := LinkOptions{Options: Options{Arch: "sm_90", Defines: map[string]string{"PYEP_NVSHMEM_PROBE": ""}},
		IncludeDirs: []string{inc}, Libraries: []string{dev}}

	dir := t.TempDir()
	c := NewCache(dir)
	c.SetLog(nil)
	cubin, err := c.CompileLinked(src, opts)
	require.NoError(t, err)
	assert.Equal(t, Stats{Compiles: 1}, c.Stats())

	f, err := elf.NewFile(bytes.NewReader(cubin))
	require.NoError(t, err)
	assert.Equal(t, elf.EM_CUDA, f.Machine)
	syms, err := f.Symbols()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, s := range syms {
		names[s.Name] = true
	}
	assert.True(t, names["pyep_nvshmem_probe"], "the kernel")
	assert.True(t, names["nvshmemi_device_state_d"], "NVSHMEM's device state")
	t.Logf("cubin of %d bytes, %d symbols", len(cubin), len(syms))

	again, err := c.CompileLinked(src, opts)
	require.NoError(t, err)
	assert.Equal(t, int64(1), c.Stats().MemoryHits)
	assert.Equal(t, cubin, again)

	c2 := NewCache(dir)
	disk, err := c2.CompileLinked(src, opts)
	require.NoError(t, err)
	assert.Equal(t, Stats{DiskHits: 1}, c2.Stats())
	assert.Equal(t, cubin, disk)

	// A plain compile of the same source is another entry: it is no linked cubin.
	plainKey, err := c.Key(src, opts.Options)
	require.NoError(t, err)
	p, err := c.linkPlan(src, opts)
	require.NoError(t, err)
	assert.NotEqual(t, plainKey, p.key)
}

// The key of a linked kernel follows its device libraries' contents, its include directories'
// files, its defines and its link flags.
func TestLinkKey(t *testing.T) {
	requireNVJitLink(t)
	root := t.TempDir()
	write := func(rel, text string) string {
		p := filepath.Join(root, rel)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(text), 0o644))
		return p
	}
	libA, libB := write("a/libdev.a", "one"), write("b/libdev.a", "two")
	libA2 := write("c/libdev.a", "one")
	write("incA/x.h", "// x")
	write("incB/x.h", "// x, longer")
	src := Source{Name: "probe.cu", Text: "__global__ void k() {}"}
	c := NewCache("")
	key := func(o LinkOptions) string {
		p, err := c.linkPlan(src, o)
		require.NoError(t, err)
		return p.key
	}
	base := LinkOptions{Options: Options{Arch: "sm_90"}, IncludeDirs: []string{filepath.Join(root, "incA")}, Libraries: []string{libA}}
	k := key(base)
	assert.Equal(t, k, key(base), "deterministic")
	o := base
	o.Libraries = []string{libA2}
	assert.Equal(t, k, key(o), "the library's contents, not its path")
	o.Libraries = []string{libB}
	assert.NotEqual(t, k, key(o), "another library")
	o = base
	o.IncludeDirs = []string{filepath.Join(root, "incB")}
	assert.NotEqual(t, k, key(o), "other headers")
	o = base
	o.Defines = map[string]string{"PYEP_X": "1"}
	assert.NotEqual(t, k, key(o), "a define")
	o = base
	o.LinkFlags = []string{"-lineinfo"}
	assert.NotEqual(t, k, key(o), "a link flag")

	_, err := c.linkPlan(src, LinkOptions{Options: Options{Arch: "sm_90"}, Libraries: []string{filepath.Join(root, "none.a")}})
	assert.ErrorContains(t, err, "device library of probe.cu")
	_, err = c.linkPlan(src, LinkOptions{Options: Options{Arch: "sm_90", PTX: true}})
	assert.ErrorContains(t, err, "PTX is not linked")
}

// A link that fails says where, with nvJitLink's log, and returns no cubin.
func TestLinkError(t *testing.T) {
	jl := requireNVJitLink(t)
	_, _, err := jl.Link([]string{"-arch=sm_90", "-lto"}, []LinkInput{{Kind: LinkLTOIR, Name: "garbage.ltoir", Data: []byte("not LTO-IR")}})
	var le *LinkError
	require.ErrorAs(t, err, &le)
	t.Log(err)
	assert.NotEmpty(t, le.Result)

	src := Source{Name: "undefined.cu", Text: `extern "C" __device__ int pyep_nowhere(int);
extern "C" __global__ void k(int* p) { *p = pyep_nowhere(*p); }`}
	_, err = NewCache("").CompileLinked(src, LinkOptions{Options: Options{Arch: "sm_90"}})
	require.ErrorAs(t, err, &le)
	assert.Equal(t, "undefined.cu", le.Name)
	assert.Contains(t, err.Error(), "pyep_nowhere")
}

// The low-latency kernels' remote build (PYEP_LL_REMOTE: kernels/remote.cuh over NVSHMEM) compiles
// to LTO-IR and links with libnvshmem_device.a under every configuration the source declares,
// without a warning, into a cubin with the kernel and NVSHMEM's device state.
func TestCompileLinkedLowLatency(t *testing.T) {
	requireNVJitLink(t)
	inc, dev := requireNVSHMEMDevice(t)
	src, err := Kernel("low_latency.cu")
	require.NoError(t, err)
	sets, err := src.DefineSets()
	require.NoError(t, err)
	require.NotEmpty(t, sets)
	c := NewCache(t.TempDir())
	c.SetLog(nil)
	for _, set := range sets {
		defines := map[string]string{"PYEP_LL_REMOTE": ""}
		for k, v := range set {
			defines[k] = v
		}
		t.Run(describeDefines(set), func(t *testing.T) {
			cubin, err := c.CompileLinked(src, LinkOptions{Options: Options{Arch: "sm_90", Defines: defines}, IncludeDirs: []string{inc},
				Libraries: []string{dev}})
			require.NoError(t, err)
			f, err := elf.NewFile(bytes.NewReader(cubin))
			require.NoError(t, err)
			syms, err := f.Symbols()
			require.NoError(t, err)
			kernel := "_ZN4pyep2ll8dispatchENS_14pyep_ll_paramsE"
			if _, ok := defines["PYEP_LL_COMBINE"]; ok {
				kernel = "_ZN4pyep2ll7combineENS_14pyep_ll_paramsE"
			}
			names := map[string]bool{}
			for _, s := range syms {
				names[s.Name] = true
			}
			assert.True(t, names[kernel], "the kernel %s", kernel)
			assert.True(t, names["nvshmemi_device_state_d"], "NVSHMEM's device state")
		})
	}
}

// A linked source hands its own headers to NVRTC under pyep/, so that a library's header of the
// same name (NVSHMEM's "utils.cuh") is found on the include path, not shadowed by ours.
func TestLinkedHeadersUnderPrefix(t *testing.T) {
	src := Source{Name: "k.cu", Text: "#include \"utils.cuh\"\n#include <nvshmem.h>\n  # include \"b.cuh\"\n",
		Headers: []Header{{Name: "b.cuh", Text: "#include \"utils.cuh\"\n#include \"other.h\"\n"}, {Name: "utils.cuh", Text: "// u"}}}
	got := src.under("pyep/")
	assert.Equal(t, "#include \"pyep/utils.cuh\"\n#include <nvshmem.h>\n  # include \"pyep/b.cuh\"\n", got.Text)
	assert.Equal(t, []Header{{Name: "pyep/b.cuh", Text: "#include \"pyep/utils.cuh\"\n#include \"other.h\"\n"},
		{Name: "pyep/utils.cuh", Text: "// u"}}, got.Headers)
	assert.Equal(t, "k.cu", got.Name)
	assert.Equal(t, "#include \"utils.cuh\"\n#include <nvshmem.h>\n  # include \"b.cuh\"\n", src.Text, "the source is not modified")
}

// An include directory that is a link to a directory (a CUDA toolkit's include is one, to
// targets/<platform>/include) has the identity of the directory it names.
func TestTreeIdentityFollowsLinkedDirectory(t *testing.T) {
	root := t.TempDir()
	real := filepath.Join(root, "targets", "include")
	require.NoError(t, os.MkdirAll(filepath.Join(real, "cuda", "std"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(real, "cuda_runtime.h"), []byte("// runtime"), 0o644))
	require.NoError(t, os.Symlink(real, filepath.Join(root, "include")))
	viaLink, err := treeIdentity(filepath.Join(root, "include"))
	require.NoError(t, err)
	direct, err := treeIdentity(real)
	require.NoError(t, err)
	assert.Equal(t, direct, viaLink)

	_, err = treeIdentity(filepath.Join(root, "targets", "cuda"))
	assert.Error(t, err, "a missing directory")
	require.NoError(t, os.MkdirAll(filepath.Join(root, "empty"), 0o755))
	_, err = treeIdentity(filepath.Join(root, "empty"))
	assert.ErrorContains(t, err, "has no files")
}
