package jit

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/dl/dltest"
)

// TestMain points the NVRTC search at this machine's Python packages when nobody else has: the
// Python layer sets PYEP_SITE_PACKAGES in real use, and here python3 (if any) tells us where
// PyTorch's NVIDIA wheels are.
func TestMain(m *testing.M) {
	dltest.UsePythonSitePackages("PYEP_NVRTC")
	os.Exit(m.Run())
}

// requireNVRTC skips (never fails) where NVRTC is absent, saying why and how to get it.
func requireNVRTC(t *testing.T) *NVRTC {
	t.Helper()
	nv, err := LoadNVRTC()
	var nf *NotFoundError
	if errors.As(err, &nf) || errors.Is(err, errNoCgo) {
		t.Skipf("NVRTC not found, so no kernel can be compiled here: %v\n"+
			"To run this test: pip install nvidia-cuda-nvrtc (or torch with CUDA), and make python3 find it "+
			"or set PYEP_SITE_PACKAGES / PYEP_NVRTC", err)
	}
	require.NoError(t, err)
	t.Logf("NVRTC %d.%d from %s", nv.Major, nv.Minor, nv.Path)
	return nv
}

func TestCandidates(t *testing.T) {
	root := t.TempDir()
	touch := func(rel string) string { return dltest.Touch(t, root, rel) }
	sp1, sp2 := filepath.Join(root, "sp1"), filepath.Join(root, "sp2")
	cu12 := touch("sp1/nvidia/cu12/lib/libnvrtc.so.12")
	cu13 := touch("sp1/nvidia/cu13/lib/libnvrtc.so.13")
	touch("sp1/nvidia/cu13/lib/libnvrtc.alt.so.13") // not ours to pick
	nvrtcPkg := touch("sp2/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
	cudaHome := touch("cuda/lib64/libnvrtc.so.12")
	venv := touch("venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13")
	bare := []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}
	usrLocal, _ := filepath.Glob("/usr/local/cuda/lib64/libnvrtc.so*") // whatever this machine has
	sort.Sort(sort.Reverse(sort.StringSlice(usrLocal)))

	tests := []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"explicit path is the only candidate", map[string]string{"PYEP_NVRTC": "/x/libnvrtc.so", "PYEP_SITE_PACKAGES": sp1}, []string{"/x/libnvrtc.so"}},
		{"nothing set: toolkit and loader", nil, nil},
		{"wheels: site-packages order, cu13 before cu12", map[string]string{"PYEP_SITE_PACKAGES": sp1 + "::" + sp2}, []string{cu13, cu12, nvrtcPkg}},
		{"CUDA_HOME after the wheels", map[string]string{"PYEP_SITE_PACKAGES": sp2, "CUDA_HOME": filepath.Join(root, "cuda")}, []string{nvrtcPkg, cudaHome}},
		{"virtualenv", map[string]string{"VIRTUAL_ENV": filepath.Join(root, "venv")}, []string{venv}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Candidates(func(k string) string { return tt.env[k] })
			if _, ok := tt.env["PYEP_NVRTC"]; ok {
				assert.Equal(t, tt.want, got)
				return
			}
			want := append(append(append([]string{}, tt.want...), usrLocal...), bare...)
			assert.Equal(t, want, got)
		})
	}
}

func TestLoadNVRTCNotFound(t *testing.T) {
	_, err := loadNVRTC([]string{"/nonexistent/libnvrtc.so.13", "libpyep-no-such-nvrtc.so"})
	if errors.Is(err, errNoCgo) {
		t.Skip("built without cgo: nothing can be loaded at all")
	}
	var nf *NotFoundError
	require.ErrorAs(t, err, &nf)
	assert.Len(t, nf.Tried, 2)
	assert.Contains(t, err.Error(), "/nonexistent/libnvrtc.so.13 (")
	assert.Contains(t, err.Error(), "pip install nvidia-cuda-nvrtc")
}

func TestDefineSets(t *testing.T) {
	tests := []struct {
		name, text string
		want       []map[string]string
		wantErr    bool
	}{
		{"none", "#include \"utils.cuh\"\n", nil, false},
		{"two lines", "// pyep:defines A=1 B=x\n//pyep:defines C\ncode();\n", []map[string]string{{"A": "1", "B": "x"}, {"C": ""}}, false},
		{"indented", "   //   pyep:defines   HIDDEN=7168\n", []map[string]string{{"HIDDEN": "7168"}}, false},
		{"not an identifier", "// pyep:defines 1A=2\n", nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Source{Name: "t.cu", Text: tt.text}.DefineSets()
			if tt.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestFromFSIncludeClosure(t *testing.T) {
	fsys := fstest.MapFS{
		"a.cu":      {Data: []byte("#include \"x.cuh\"\n#include <cuda_fp16.h>\n")},
		"x.cuh":     {Data: []byte("  #  include \"y.cuh\"\n#include \"x.cuh\"\n")},
		"y.cuh":     {Data: []byte("// y\n")},
		"z.cuh":     {Data: []byte("// unrelated\n")},
		"sub/b.cu":  {Data: []byte("#include \"c.cuh\"\n#include \"x.cuh\"\n")},
		"sub/c.cuh": {Data: []byte("// c\n")},
	}
	names := func(s Source) []string {
		var out []string
		for _, h := range s.Headers {
			out = append(out, h.Name)
		}
		return out
	}
	a, err := FromFS(fsys, "a.cu")
	require.NoError(t, err)
	assert.Equal(t, []string{"x.cuh", "y.cuh"}, names(a), "only what a.cu includes, transitively; <cuda_fp16.h> is left to NVRTC")

	b, err := FromFS(fsys, "sub/b.cu")
	require.NoError(t, err)
	assert.Equal(t, []string{"c.cuh", "x.cuh", "y.cuh"}, names(b), "relative to the includer, then the root")

	_, err = FromFS(fsys, "missing.cu")
	assert.Error(t, err)
}

func TestOptions(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		want    []string
		wantErr string
	}{
		{"cubin", Options{Arch: "sm_90"}, []string{"--gpu-architecture=sm_90", "-std=c++17"}, ""},
		{"defines sorted, flags last", Options{Arch: "sm_90a", Defines: map[string]string{"PYEP_B": "2", "PYEP_A": "", "PYEP_HIDDEN_BYTES": "14336"}, Flags: []string{"-lineinfo"}},
			[]string{"--gpu-architecture=sm_90a", "-std=c++17", "-DPYEP_A", "-DPYEP_B=2", "-DPYEP_HIDDEN_BYTES=14336", "-lineinfo"}, ""},
		{"ptx takes the virtual arch", Options{Arch: "sm_90", PTX: true}, []string{"--gpu-architecture=compute_90", "-std=c++17"}, ""},
		{"virtual arch needs ptx", Options{Arch: "compute_90"}, nil, "virtual"},
		{"bad arch", Options{Arch: "90"}, nil, "expected sm_XX"},
		{"bad define", Options{Arch: "sm_90", Defines: map[string]string{"A-B": "1"}}, nil, "identifier"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.opts.nvrtcOptions()
			if tt.wantErr != "" {
				assert.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestCacheKey(t *testing.T) {
	src := Source{Name: "kernels/k.cu", Text: "k", Headers: []Header{{"utils.cuh", "u"}}}
	opts := Options{Arch: "sm_90", Defines: map[string]string{"PYEP_HIDDEN_BYTES": "14336", "PYEP_RANKS": "8"}}
	key := func(src Source, opts Options, version string) string {
		flags, err := opts.nvrtcOptions()
		require.NoError(t, err)
		return nvrtcKey(src, flags, opts.PTX, version)
	}
	base := key(src, opts, "13.0")
	// NVRTC's keys are those keyVersion 1 has always made (a GPU host's cache stays warm):
	// values computed before the host compiler shared the recipe.
	assert.Equal(t, "b7dae87f5d3f69fab1d080ed1828a2894b46dd3f030721cf942c7f05269effb5", key(src, opts, "12.8"))
	assert.Equal(t, "0817c54d88faf52d758013bc45f77d52c2710706c6af8136e5fba1024f13d678", key(src, Options{Arch: "sm_90", PTX: true}, "12.8"))
	assert.Len(t, base, 64)
	assert.Equal(t, base, key(src, Options{Arch: "sm_90", Defines: map[string]string{"PYEP_RANKS": "8", "PYEP_HIDDEN_BYTES": "14336"}}, "13.0"),
		"map order must not matter")

	with := func(f func(*Source, *Options)) (Source, Options) {
		s, o := src, opts
		s.Headers = append([]Header(nil), src.Headers...)
		o.Defines = map[string]string{}
		for k, v := range opts.Defines {
			o.Defines[k] = v
		}
		f(&s, &o)
		return s, o
	}
	changes := []struct {
		name    string
		change  func(*Source, *Options)
		version string
	}{
		{"define value", func(_ *Source, o *Options) { o.Defines["PYEP_HIDDEN_BYTES"] = "7168" }, "13.0"},
		{"added define", func(_ *Source, o *Options) { o.Defines["PYEP_FP8"] = "1" }, "13.0"},
		{"arch", func(_ *Source, o *Options) { o.Arch = "sm_100" }, "13.0"},
		{"flags", func(_ *Source, o *Options) { o.Flags = []string{"-lineinfo"} }, "13.0"},
		{"ptx", func(_ *Source, o *Options) { o.PTX = true }, "13.0"},
		{"source text", func(s *Source, _ *Options) { s.Text += " " }, "13.0"},
		{"header text", func(s *Source, _ *Options) { s.Headers[0].Text = "u2" }, "13.0"},
		{"header name", func(s *Source, _ *Options) { s.Headers[0].Name = "u.cuh" }, "13.0"},
		{"nvrtc version", func(*Source, *Options) {}, "13.1"},
	}
	for _, c := range changes {
		s, o := with(c.change)
		assert.NotEqual(t, base, key(s, o, c.version), c.name)
	}
}

func TestCacheFileName(t *testing.T) {
	key := strings.Repeat("ab", 32)
	assert.Equal(t, "intranode-sm_90-"+key[:32]+".cubin", cacheFileName("kernels/intranode.cu", Options{Arch: "sm_90"}, key))
	assert.Equal(t, "my_k-sm_90a-"+key[:32]+".ptx", cacheFileName("my k.cu", Options{Arch: "sm_90a", PTX: true}, key))
}

func TestDefaultDir(t *testing.T) {
	t.Setenv("PYEP_JIT_CACHE_DIR", "/tmp/pyep-x")
	d, err := DefaultDir()
	require.NoError(t, err)
	assert.Equal(t, "/tmp/pyep-x", d)

	t.Setenv("PYEP_JIT_CACHE_DIR", "")
	t.Setenv("XDG_CACHE_HOME", "/tmp/xdg")
	d, err = DefaultDir()
	require.NoError(t, err)
	assert.Equal(t, "/tmp/xdg/pyep", d)
}

// TestCompileKernels compiles every embedded kernel for sm_90 under each configuration it
// declares: the CI guard against kernels (or utils.cuh) that do not compile.
func TestCompileKernels(t *testing.T) {
	nv := requireNVRTC(t)
	names, err := KernelNames()
	require.NoError(t, err)
	require.Contains(t, names, "selftest.cu")
	for _, name := range names {
		src, err := Kernel(name)
		require.NoError(t, err)
		require.NotEmpty(t, src.Headers, "%s includes utils.cuh", name)
		sets, err := src.DefineSets()
		require.NoError(t, err)
		if len(sets) == 0 {
			sets = []map[string]string{nil}
		}
		for _, defines := range sets {
			t.Run(fmt.Sprintf("%s%s", name, describeDefines(defines)), func(t *testing.T) {
				flags, err := Options{Arch: "sm_90", Defines: defines}.nvrtcOptions()
				require.NoError(t, err)
				start := time.Now()
				cubin, log, err := nv.Compile(src.Name, src.Text, src.Headers, flags, false)
				require.NoError(t, err)
				t.Logf("%d-byte cubin in %v", len(cubin), time.Since(start).Round(time.Millisecond))
				assert.True(t, bytes.HasPrefix(cubin, []byte("\x7fELF")), "a cubin is an ELF image")
				assert.Empty(t, strings.TrimSpace(log), "kernels compile without warnings")
			})
		}
	}
}

func TestCompilePTX(t *testing.T) {
	requireNVRTC(t)
	t.Setenv("PYEP_JIT_QUIET", "1")
	src, err := Kernel("selftest.cu")
	require.NoError(t, err)
	ptx, err := NewCache("").Compile(src, Options{Arch: "sm_90", PTX: true})
	require.NoError(t, err)
	assert.Contains(t, string(ptx), ".target sm_90")
	assert.Contains(t, string(ptx), ".entry pyep_selftest(", "extern \"C\" keeps the entry's name plain")
	assert.NotContains(t, string(ptx), "\x00")
}

func TestCacheHits(t *testing.T) {
	requireNVRTC(t)
	t.Setenv("PYEP_JIT_QUIET", "")
	dir := t.TempDir()
	src, err := Kernel("selftest.cu")
	require.NoError(t, err)
	opts := Options{Arch: "sm_90", Defines: map[string]string{"PYEP_SELFTEST_SCALE": "2"}}

	var log bytes.Buffer
	c := NewCache(dir)
	c.SetLog(&log)
	start := time.Now()
	cold, err := c.Compile(src, opts)
	coldTime := time.Since(start)
	require.NoError(t, err)
	assert.Equal(t, Stats{Compiles: 1}, c.Stats())
	assert.Regexp(t, `^pyep: compiled kernels/selftest\.cu for sm_90 \(SELFTEST_SCALE=2\) in \d+ ms; cached at `+
		regexp.QuoteMeta(dir)+`/selftest-sm_90-[0-9a-f]{32}\.cubin\n$`, log.String())

	start = time.Now()
	warm, err := c.Compile(src, opts)
	memTime := time.Since(start)
	require.NoError(t, err)
	assert.Equal(t, Stats{Compiles: 1, MemoryHits: 1}, c.Stats())
	assert.Equal(t, cold, warm)

	// A fresh cache over the same directory stands for the next process.
	log.Reset()
	c2 := NewCache(dir)
	c2.SetLog(&log)
	start = time.Now()
	disk, err := c2.Compile(src, opts)
	diskTime := time.Since(start)
	require.NoError(t, err)
	assert.Equal(t, Stats{DiskHits: 1}, c2.Stats())
	assert.Equal(t, cold, disk)
	assert.Empty(t, log.String(), "only cold compiles are reported")
	t.Logf("cold compile %v, disk hit %v, memory hit %v", coldTime.Round(time.Millisecond), diskTime.Round(time.Microsecond), memTime.Round(time.Microsecond))

	// Another define is another key: a new compile and a second file.
	t.Setenv("PYEP_JIT_QUIET", "1")
	k1, err := c2.Key(src, opts)
	require.NoError(t, err)
	opts3 := Options{Arch: "sm_90", Defines: map[string]string{"PYEP_SELFTEST_SCALE": "3"}}
	k3, err := c2.Key(src, opts3)
	require.NoError(t, err)
	assert.NotEqual(t, k1, k3)
	_, err = c2.Compile(src, opts3)
	require.NoError(t, err)
	assert.Equal(t, Stats{DiskHits: 1, Compiles: 1}, c2.Stats())
	assert.Empty(t, log.String(), "PYEP_JIT_QUIET=1 silences the report")
	files, err := filepath.Glob(filepath.Join(dir, "*"))
	require.NoError(t, err)
	assert.Len(t, files, 2, "one file per key, no temporary files left behind")

	// A damaged file is recompiled and replaced rather than handed to the driver.
	require.Len(t, files, 2)
	for _, f := range files {
		require.NoError(t, os.WriteFile(f, []byte("garbage"), 0o644))
	}
	c3 := NewCache(dir)
	again, err := c3.Compile(src, opts)
	require.NoError(t, err)
	assert.Equal(t, cold, again)
	assert.Equal(t, Stats{Compiles: 1}, c3.Stats())
}

func TestCacheConcurrent(t *testing.T) {
	requireNVRTC(t)
	t.Setenv("PYEP_JIT_QUIET", "1")
	dir := t.TempDir()
	src, err := Kernel("selftest.cu")
	require.NoError(t, err)
	opts := Options{Arch: "sm_90", Defines: map[string]string{"PYEP_SELFTEST_SCALE": "5"}}

	// Goroutines of one cache share one compile; two caches (two processes) on one directory
	// each compile and rename over each other without harm.
	caches := []*Cache{NewCache(dir), NewCache(dir)}
	const perCache = 4
	results := make([][]byte, 2*perCache)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := caches[i%2].Compile(src, opts)
			assert.NoError(t, err)
			results[i] = out
		}()
	}
	wg.Wait()
	for _, r := range results {
		assert.Equal(t, results[0], r)
	}
	for _, c := range caches {
		s := c.Stats()
		assert.Equal(t, int64(perCache), s.Compiles+s.DiskHits+s.MemoryHits)
		assert.LessOrEqual(t, s.Compiles+s.DiskHits, int64(1), "one cache compiles (or reads) a key once")
	}
	files, err := filepath.Glob(filepath.Join(dir, "*"))
	require.NoError(t, err)
	assert.Len(t, files, 1)
	hidden, err := filepath.Glob(filepath.Join(dir, ".*"))
	require.NoError(t, err)
	assert.Empty(t, hidden, "no temporary files left behind")
}

func TestCompileError(t *testing.T) {
	requireNVRTC(t)
	c := NewCache(t.TempDir())
	src := Source{Name: "kernels/broken.cu", Text: "#include \"utils.cuh\"\nextern \"C\" __global__ void k() { undeclared_thing(); }\n",
		Headers: []Header{{"utils.cuh", "#pragma once\n"}}}
	_, err := c.Compile(src, Options{Arch: "sm_90"})
	var ce *CompileError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "compile", ce.Stage)
	assert.Contains(t, err.Error(), "kernels/broken.cu")
	assert.Contains(t, err.Error(), "undeclared_thing", "the message carries NVRTC's log")
	assert.Equal(t, Stats{}, c.Stats())
	files, _ := filepath.Glob(filepath.Join(c.Dir(), "*"))
	assert.Empty(t, files, "failures are not cached")

	_, err = c.Compile(src, Options{Arch: "sm_90", Flags: []string{"--no-such-flag"}})
	require.ErrorAs(t, err, &ce)
	assert.Contains(t, err.Error(), "no-such-flag")
}
