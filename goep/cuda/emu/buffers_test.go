//go:build cgo

package emu_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/emu"
)

// addBuffer makes one more synced Buffer of nvlBytes on every rank's Backend of envs (as a
// process keeps several Buffers on its one shared Backend) and returns envs on it.
func addBuffer(t *testing.T, envs []*rankEnv, nvlBytes int64) []*rankEnv {
	t.Helper()
	R := len(envs)
	out := make([]*rankEnv, R)
	handles := make([][]byte, R)
	for r, e := range envs {
		buf, err := goep.NewBuffer(goep.Params{Rank: r, NumRanks: R, NumNVLBytes: nvlBytes, Engines: engines}, e.be)
		require.NoError(t, err)
		handles[r], err = buf.LocalIPCHandle()
		require.NoError(t, err)
		out[r] = &rankEnv{r: r, drv: e.drv, be: e.be, buf: buf}
	}
	ids := make([]int, R)
	for r := range ids {
		ids[r] = r
	}
	for _, e := range out {
		require.NoError(t, e.buf.Sync(ids, handles, nil))
	}
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, e := range out {
			wg.Add(1)
			go func() { defer wg.Done(); assert.NoError(t, e.buf.Destroy()) }()
		}
		wg.Wait()
	})
	return out
}

func hint(t *testing.T, c goep.Config, hiddenBytes, R int) int64 {
	n, err := c.NVLBufferSizeHint(hiddenBytes, R)
	require.NoError(t, err)
	return n
}

// tests/test_normal.py's first ten cases on four ranks, in its order, with its buffers: one
// Buffer per size hint, kept alive (A: hidden 256, B: hidden 7168, C: hidden 2880), all on
// each rank's one Backend. On 4 GPUs the combine of hidden 2880 on the third Buffer failed
// with an illegal memory access.
func TestEmulatedBufferSequence(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of threads")
	}
	const R = 4
	c := cfg(20, 6, 256)
	base := rcase{R: R, T: 96, E: 16, K: 8, hidden: 256, dtype: bf16, cfg: c, align: 1, bias: 2}
	a := newDomainWith(t, R, hint(t, c, 512, R), emu.Options4())
	for _, k := range []struct {
		name string
		mod  func(*rcase)
	}{
		{"random", func(*rcase) {}},
		{"topk1", func(c *rcase) { c.K = 1 }},
		{"topk9", func(c *rcase) { c.K, c.E = 9, 12 }},
		{"silent_rank", func(c *rcase) { c.silent = 1 }},
		{"zero_tokens", func(c *rcase) { c.T = 0 }},
	} {
		cc := base
		cc.name = k.name
		k.mod(&cc)
		t.Run("A_"+k.name, func(t *testing.T) { runCase(t, a, cc) })
	}
	b := addBuffer(t, a, hint(t, c, 14336, R))
	big := base
	big.T, big.hidden = 48, 7168
	t.Run("B_hidden_7168", func(t *testing.T) { runCase(t, b, big) })
	cbuf := addBuffer(t, a, hint(t, c, 5760, R))
	odd := base
	odd.T, odd.hidden = 48, 2880
	t.Run("C_hidden_2880", func(t *testing.T) { runCase(t, cbuf, odd) })
}
