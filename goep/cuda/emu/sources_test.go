package emu_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/kernels"
)

// cgo compiles only files of this folder, so the emulator builds copies of the kernel sources;
// they must be the kernels that NVRTC compiles, byte for byte.
func TestKernelCopiesMatchKernels(t *testing.T) {
	for copyName, source := range map[string]string{"kernels_intranode.h": "intranode.cu", "kernels_layout.h": "layout.cu"} {
		want, err := kernels.FS.ReadFile(source)
		require.NoError(t, err)
		got, err := os.ReadFile(copyName)
		require.NoError(t, err)
		assert.Equal(t, string(want), string(got), "%s differs from kernels/%s: run `cp kernels/%s goep/cuda/emu/%s`", copyName, source, source, copyName)
	}
}
