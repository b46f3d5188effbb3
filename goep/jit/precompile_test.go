package jit_test

import (
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	cudanormal "github.com/pyep/pyep/goep/cuda/normal"
	"github.com/pyep/pyep/goep/jit"
)

// TestPrecompileNormal fills the kernel cache (PYEP_JIT_CACHE_DIR) with the variants that the
// normal-mode test suites and the quick timing compile on a GPU, for the ranks in
// PYEP_PRECOMPILE (e.g. "2 4") and the arch in PYEP_PRECOMPILE_ARCH (sm_90): a GPU run that
// carries the directory then compiles (almost) nothing. Skipped unless PYEP_PRECOMPILE is set.
func TestPrecompileNormal(t *testing.T) {
	ranks := strings.Fields(os.Getenv("PYEP_PRECOMPILE"))
	if len(ranks) == 0 {
		t.Skip("set PYEP_PRECOMPILE to the rank counts to precompile for")
	}
	arch := os.Getenv("PYEP_PRECOMPILE_ARCH")
	if arch == "" {
		arch = "sm_90"
	}
	intranode, err := jit.Kernel("intranode.cu")
	require.NoError(t, err)
	layout, err := jit.Kernel("layout.cu")
	require.NoError(t, err)
	type job struct {
		src     jit.Source
		defines map[string]string
	}
	var jobs []job
	add := func(src jit.Source, d map[string]string) { jobs = append(jobs, job{src, d}) }
	vec := func(rowBytes int) int {
		for v := 16; v > 1; v /= 2 {
			if rowBytes%v == 0 {
				return v
			}
		}
		return 1
	}
	add(layout, cudanormal.LayoutDefines(512))
	type shape struct{ hidden, es, scales, topk, combineDT int } // combineDT 0: no combine of this shape
	var shapes []shape
	for _, k := range []int{8, 1, 9} {
		shapes = append(shapes, shape{256, 2, 0, k, 1})
	}
	shapes = append(shapes,
		shape{7168, 2, 0, 8, 1}, shape{2880, 2, 0, 8, 1}, shape{8192, 2, 0, 8, 1}, shape{2048, 2, 0, 8, 1},
		shape{7168, 1, 224, 8, 1}, shape{2880, 1, 88, 8, 1}, shape{8192, 1, 256, 8, 1}, shape{512, 1, 16, 8, 1},
		shape{256, 4, 0, 8, 3}, shape{256, 2, 0, 8, 2}, shape{1024, 2, 0, 8, 1}, shape{512, 2, 0, 8, 1})
	for _, h := range []int{64, 128, 512} {
		for k := 1; k <= 4; k++ {
			shapes = append(shapes, shape{h, 2, 0, k, 0})
		}
		shapes = append(shapes, shape{h, 2, 0, 0, 1})
	}
	for _, rs := range ranks {
		R, err := strconv.Atoi(rs)
		require.NoError(t, err)
		add(intranode, cudanormal.NotifyDefines(R, 1024))
		combine := cudanormal.ShapeFor(cudanormal.OpCombine, R, 0, 0)
		for _, s := range shapes {
			hb := s.hidden * s.es
			queued, counted := cudanormal.OpDispatch, cudanormal.OpDispatchCounted
			if s.scales > 0 {
				queued, counted = cudanormal.OpDispatchFP8, cudanormal.OpDispatchFP8
			}
			q, d := cudanormal.ShapeFor(queued, R, 0, 0), cudanormal.ShapeFor(counted, R, 0, 0)
			add(intranode, cudanormal.DispatchDefines(R, hb, s.scales, s.topk, vec(hb), d))
			add(intranode, cudanormal.NotifyDispatchDefines(R, hb, s.scales, s.topk, vec(hb), q)) // queued
			add(intranode, cudanormal.DispatchDefines(R, hb, s.scales, 0, vec(hb), d))
			if s.combineDT != 0 {
				ces := map[int]int{1: 2, 2: 2, 3: 4}[s.combineDT]
				for _, k := range []int{s.topk, 0} {
					add(intranode, cudanormal.CombineDefines(R, s.hidden, s.combineDT, k, 0, max(vec(s.hidden*ces), ces), combine))
				}
			}
		}
	}
	c := jit.Default()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for _, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			_, err := c.Compile(j.src, jit.Options{Arch: arch, Defines: j.defines})
			require.NoError(t, err)
		}()
	}
	wg.Wait()
	t.Logf("%d variants: %+v", len(jobs), c.Stats())
}
