//go:build cgo

package emu_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// The layout kernel against goep/normal's layout over shapes that take each of its paths: no
// tokens, several blocks (the emulator's blocks are 64 threads), more choices than it loads at once
// (an odd number, and an even one loaded two at a time), rows written four bytes at a time and one
// at a time, more ranks than a token's rank mask holds, more experts than its shared counts hold,
// an even K whose rows are 8- but not 16-byte aligned (loaded one at a time). Each shape runs twice
// on one engine, the second time into outputs that start as garbage: every layout must leave its
// gate closed for the next and write every output. With PYEP_EMU_RESIDENT_BLOCKS=1 too: the blocks,
// one at a time, need none of the others to run at once (they wait only for block 0).
func TestEmulatedLayoutShapes(t *testing.T) {
	t.Run("all_resident", func(t *testing.T) { layoutShapes(t) })
	t.Run("resident_1", func(t *testing.T) {
		t.Setenv("PYEP_EMU_RESIDENT_BLOCKS", "1")
		layoutShapes(t)
	})
}

func layoutShapes(t *testing.T) {
	envs := newDomain(t, 1, 8<<20)
	e := envs[0]
	rng := rand.New(rand.NewPCG(7, 11))
	for _, s := range []struct {
		T, K, E, R int
		misaligned bool
	}{
		{0, 4, 8, 2, false}, {1, 1, 1, 1, false}, {200, 9, 24, 3, false}, {70, 8, 16, 8, false}, {150, 6, 144, 72, false},
		{100, 6, 4100, 2, false}, {65, 2, 4, 4, false}, {1100, 4, 32, 4, false}, {130, 10, 40, 4, false},
		{130, 8, 32, 2, true},
	} {
		t.Run(fmt.Sprintf("T%d_K%d_E%d_R%d_misaligned%v", s.T, s.K, s.E, s.R, s.misaligned), func(t *testing.T) {
			topk := make([]int64, s.T*s.K)
			for i := range topk {
				topk[i] = int64(rng.IntN(s.E+1)) - 1 // -1: no expert
			}
			perRank, perExpert, inRank := make([]int32, s.R), make([]int32, s.E), make([]bool, s.T*s.R)
			require.NoError(t, normal.Layout(topk, s.T, s.K, s.E, s.R, perRank, perExpert, inRank))
			dTopk := e.upload(t, dlpack.I64, bytesOf(topk), int64(s.T), int64(s.K))
			if s.misaligned { // the same indices one word into a 16-byte aligned allocation
				d := e.alloc(t, dlpack.I64, int64(s.T*s.K+1))
				copy(d.b[8:], bytesOf(topk))
				dTopk = dev{t: d.t, b: d.b[8:]}
				dTopk.t.Data, dTopk.t.Shape = unsafe.Add(d.t.Data, 8), []int64{int64(s.T), int64(s.K)}
			}
			for round := range 2 {
				dRank, dExpert := e.alloc(t, dlpack.I32, int64(s.R)), e.alloc(t, dlpack.I32, int64(s.E))
				dIn := e.alloc(t, dlpack.BoolT, int64(s.T), int64(s.R))
				for _, b := range [][]byte{dRank.b, dExpert.b, dIn.b} {
					for i := range b {
						b[i] = byte(0x5a * round)
					}
				}
				require.NoError(t, e.normal().Layout(&goep.LayoutOp{NumExperts: s.E, NumRanks: s.R, TopkIdx: dTopk.t,
					PerRank: dRank.t, PerExpert: dExpert.t, InRank: dIn.t}))
				require.Equal(t, perRank, i32s(dRank.b), "round %d: num_tokens_per_rank", round)
				require.Equal(t, perExpert, i32s(dExpert.b), "round %d: num_tokens_per_expert", round)
				require.Equal(t, inRank, bools(dIn.b), "round %d: is_token_in_rank", round)
			}
		})
	}
}
