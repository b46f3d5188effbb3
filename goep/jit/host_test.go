//go:build cgo

package jit

import (
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// requireHostCompiler skips (never fails) where there is no C++ compiler, saying why.
func requireHostCompiler(t *testing.T) {
	t.Helper()
	if _, err := findHostCompiler(); err != nil {
		t.Skipf("no host C++ compiler, so nothing can be built for the host here: %v", err)
	}
}

// hostSource exports pyep_answer = PYEP_A * PYEP_B (from its header) as a default-visible int.
var hostSource = Source{Name: "kernels/answer.cu", Text: "#include \"b.cuh\"\n" +
	"extern \"C\" __attribute__((visibility(\"default\"))) const int pyep_answer = PYEP_A * kB;\n" +
	"extern \"C\" const int pyep_hidden = 1;\n",
	Headers: []Header{{"b.cuh", "#pragma once\nconstexpr int kB = PYEP_B;\n"}}}

func answer(t *testing.T, lib *Library) int32 {
	t.Helper()
	p, err := lib.Symbol("pyep_answer")
	require.NoError(t, err)
	return *(*int32)(p)
}

func TestCompileHost(t *testing.T) {
	requireHostCompiler(t)
	t.Setenv("PYEP_JIT_QUIET", "1")
	dir := t.TempDir()
	c := NewCache(dir)
	opts := HostOptions{Defines: map[string]string{"PYEP_A": "6", "PYEP_B": "7"}}
	lib, err := c.CompileHost(hostSource, opts)
	require.NoError(t, err)
	assert.Equal(t, int32(42), answer(t, lib))
	assert.Equal(t, Stats{Compiles: 1}, c.Stats())
	assert.Regexp(t, `/answer-host-[0-9a-f]{32}\.so$`, lib.Path)
	_, err = lib.Symbol("pyep_hidden")
	assert.Error(t, err, "symbols are hidden unless the source exports them")

	again, err := c.CompileHost(hostSource, opts)
	require.NoError(t, err)
	assert.Same(t, lib, again)
	assert.Equal(t, Stats{Compiles: 1, MemoryHits: 1}, c.Stats())

	// The next process finds it on disk.
	c2 := NewCache(dir)
	disk, err := c2.CompileHost(hostSource, opts)
	require.NoError(t, err)
	assert.Equal(t, Stats{DiskHits: 1}, c2.Stats())
	assert.Equal(t, int32(42), answer(t, disk))

	// Any define, header or source change is a new key, hence a new build.
	changed := []struct {
		name string
		src  Source
		opts HostOptions
		want int32
	}{
		{"define", hostSource, HostOptions{Defines: map[string]string{"PYEP_A": "5", "PYEP_B": "7"}}, 35},
		{"header", Source{Name: hostSource.Name, Text: hostSource.Text,
			Headers: []Header{{"b.cuh", "#pragma once\nconstexpr int kB = PYEP_B + 1;\n"}}}, opts, 48},
		{"source", Source{Name: hostSource.Name, Text: hostSource.Text + "// edited\n", Headers: hostSource.Headers}, opts, 42},
	}
	for _, ch := range changed {
		lib, err := c2.CompileHost(ch.src, ch.opts)
		require.NoError(t, err, ch.name)
		assert.Equal(t, ch.want, answer(t, lib), ch.name)
	}
	assert.Equal(t, Stats{DiskHits: 1, Compiles: 3}, c2.Stats())
	files, err := filepath.Glob(filepath.Join(dir, "*"))
	require.NoError(t, err)
	assert.Len(t, files, 4, "one library per key")
	hidden, err := filepath.Glob(filepath.Join(dir, ".*"))
	require.NoError(t, err)
	assert.Empty(t, hidden, "no build directories left behind")

	// A damaged library (one this process never loaded: the loader keeps what it mapped) is
	// built again rather than loaded.
	damaged := HostOptions{Defines: map[string]string{"PYEP_A": "1", "PYEP_B": "2"}}
	flags, err := damaged.hostOptions()
	require.NoError(t, err)
	hc, err := findHostCompiler()
	require.NoError(t, err)
	key := cacheKey(keyInput{compiler: hc.identity, output: "so", flags: flags, src: hostSource})
	require.NoError(t, os.WriteFile(filepath.Join(dir, entryFileName(hostSource.Name, "host", key, ".so")), []byte("garbage"), 0o755))
	c3 := NewCache(dir)
	rebuilt, err := c3.CompileHost(hostSource, damaged)
	require.NoError(t, err)
	assert.Equal(t, int32(2), answer(t, rebuilt))
	assert.Equal(t, Stats{Compiles: 1}, c3.Stats())
}

// The host's key follows the same recipe as NVRTC's, with the compiler's identity in it.
func TestHostKeyNamesTheCompiler(t *testing.T) {
	requireHostCompiler(t)
	hc, err := findHostCompiler()
	require.NoError(t, err)
	assert.Contains(t, hc.identity, hc.argv[0])
	flags, err := HostOptions{Defines: map[string]string{"PYEP_A": "1"}}.hostOptions()
	require.NoError(t, err)
	assert.Contains(t, flags, "-DPYEP_A=1")
	k := func(compiler string) string {
		return cacheKey(keyInput{compiler: compiler, output: "so", flags: flags, src: hostSource})
	}
	assert.NotEqual(t, k(hc.identity), k(hc.identity+" "), "another compiler is another key")
	assert.NotEqual(t, k(hc.identity), nvrtcKey(hostSource, flags, false, hc.identity), "a cubin is not a library")
}

func TestCompileHostConcurrent(t *testing.T) {
	requireHostCompiler(t)
	t.Setenv("PYEP_JIT_QUIET", "1")
	dir := t.TempDir()
	opts := HostOptions{Defines: map[string]string{"PYEP_A": "3", "PYEP_B": "3"}}
	// Goroutines of one cache share one build; two caches (two processes) on one directory
	// each build and rename over each other without harm.
	caches := []*Cache{NewCache(dir), NewCache(dir)}
	const perCache = 3
	var wg sync.WaitGroup
	for i := range 2 * perCache {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lib, err := caches[i%2].CompileHost(hostSource, opts)
			if assert.NoError(t, err) {
				assert.Equal(t, int32(9), *(*int32)(must(lib.Symbol("pyep_answer"))))
			}
		}()
	}
	wg.Wait()
	for _, c := range caches {
		s := c.Stats()
		assert.Equal(t, int64(perCache), s.Compiles+s.DiskHits+s.MemoryHits)
		assert.LessOrEqual(t, s.Compiles+s.DiskHits, int64(1), "one cache builds (or loads) a key once")
	}
	files, err := filepath.Glob(filepath.Join(dir, "*"))
	require.NoError(t, err)
	assert.Len(t, files, 1)
	hidden, err := filepath.Glob(filepath.Join(dir, ".*"))
	require.NoError(t, err)
	assert.Empty(t, hidden, "no build directories left behind")
}

func must(p unsafe.Pointer, err error) unsafe.Pointer {
	if err != nil {
		panic(err)
	}
	return p
}

func TestCompileHostError(t *testing.T) {
	requireHostCompiler(t)
	c := NewCache("")
	_, err := c.CompileHost(Source{Name: "kernels/broken.cu", Text: "int f() { return undeclared_thing; }\n"}, HostOptions{})
	var ce *CompileError
	require.ErrorAs(t, err, &ce)
	assert.Contains(t, err.Error(), "kernels/broken.cu")
	assert.Contains(t, err.Error(), "undeclared_thing", "the message carries the compiler's output")
	assert.NotContains(t, err.Error(), "pyep-jit-", "file names are the source's, not the build directory's")
	assert.Equal(t, Stats{}, c.Stats())

	// A memory-only cache builds in a temporary directory, gone once the library is loaded.
	t.Setenv("PYEP_JIT_QUIET", "1")
	lib, err := c.CompileHost(hostSource, HostOptions{Defines: map[string]string{"PYEP_A": "2", "PYEP_B": "2"}})
	require.NoError(t, err)
	assert.Equal(t, int32(4), answer(t, lib))
	_, err = os.Stat(lib.Path)
	assert.True(t, os.IsNotExist(err), "the temporary build is removed")

	t.Setenv("CXX", "pyep-no-such-compiler")
	_, err = NewCache("").CompileHost(hostSource, HostOptions{})
	assert.ErrorContains(t, err, "pyep-no-such-compiler")
	_, lookErr := exec.LookPath("pyep-no-such-compiler")
	require.Error(t, lookErr)
}
