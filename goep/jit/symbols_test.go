package jit_test

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/jit"
)

// TestGPUSymbols compiles each kernel file to PTX under every configuration it declares and checks that each
// symbol the GPU loads from it is one of its entries. The emulator loads the C twins, so only this test sees a
// GPU symbol that the compiler names otherwise (a mangled C++ name changes with its parameters' types).
func TestGPUSymbols(t *testing.T) {
	if _, err := jit.LoadNVRTC(); err != nil {
		t.Skipf("NVRTC not found, so no kernel can be compiled here: %v", err)
	}
	t.Setenv("PYEP_JIT_QUIET", "1")
	cache := jit.NewCache(t.TempDir())
	entry := regexp.MustCompile(`\.entry\s+([A-Za-z0-9_]+)\(`)
	for file, symbols := range cuda.GPUSymbols() {
		src, err := jit.Kernel(file)
		require.NoError(t, err)
		sets, err := src.DefineSets()
		require.NoError(t, err)
		require.NotEmpty(t, sets, "%s declares the configurations it compiles under", file)
		entries := map[string]bool{}
		for _, defines := range sets {
			ptx, err := cache.Compile(src, jit.Options{Arch: "sm_90", PTX: true, Defines: defines})
			require.NoError(t, err, "%s %v", file, defines)
			for _, m := range entry.FindAllStringSubmatch(string(ptx), -1) {
				entries[m[1]] = true
			}
		}
		for _, s := range symbols {
			assert.True(t, entries[s], "%s: no entry %s among %v", file, s, entries)
		}
	}
}
