package lowlatency

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// nodes is the path table of rank r when each perNode consecutive ranks are a node (0: one node)
// and, with noNVLink, every peer is remote (allow_nvlink_for_low_latency_mode=False).
func nodes(R, perNode int, noNVLink bool) func(r int) []bool {
	return func(r int) []bool {
		if perNode == 0 && !noNVLink {
			return nil
		}
		remote := make([]bool, R)
		for p := range remote {
			remote[p] = p != r && (noNVLink || p/perNode != r/perNode)
		}
		return remote
	}
}

func newPathGroup(t *testing.T, R int, s Shape, paths func(r int) []bool) *group {
	t.Helper()
	g := newGroup(t, R, s, false, 20*time.Second)
	for r, e := range g.engines {
		e.d.Remote = paths(r)
	}
	return g
}

// bytesOf is the memory of s, for comparing outputs bit for bit.
func bytesOf[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(s[0])))
}

// runCalls makes the same sequence of low-latency calls on every rank of g (dispatches in BF16,
// FP8, with round_scale and UE8M0, with and without hooks; combines of what each dispatch
// received, one of them zero-copy, each checked against refCombine) and returns, per rank, every
// output of every call in order (not the wait statistics, which are times).
func runCalls(t *testing.T, g *group, R int, s Shape, K int) [][]byte {
	t.Helper()
	out := make([][]byte, R)
	rng := rand.New(rand.NewPCG(7, uint64(R)))
	L, RM, H := s.NumExperts/R, R*s.MaxTokens, s.Hidden
	modes := []struct{ fp8, round, ue8m0, hook, zeroCopy bool }{
		{}, {hook: true}, {fp8: true}, {fp8: true, round: true, hook: true}, {fp8: true, round: true, ue8m0: true},
		{zeroCopy: true}, {},
	}
	for i, m := range modes {
		tokens := make([]int, R)
		for r := range tokens {
			tokens[r] = rng.IntN(s.MaxTokens + 1)
		}
		tokens[i%R] = s.MaxTokens
		in := inputs(rng, R, K, s, tokens)
		args := make([]*DispatchArgs, R)
		errs := g.each(func(r int, e *Engine) error {
			args[r] = dispatchArgs(s, R, K, in[r], m.fp8, m.round, m.ue8m0)
			recv, err := e.Dispatch(args[r])
			if err != nil {
				return err
			}
			if m.hook {
				time.Sleep(time.Millisecond)
			}
			return recv.Finish()
		})
		for _, err := range errs {
			require.NoError(t, err, "call %d", i)
		}
		for r, a := range args {
			for _, b := range [][]byte{a.RecvX, bytesOf(a.RecvScales), bytesOf(a.SrcInfo), bytesOf(a.LayoutRange),
				bytesOf(a.Count), bytesOf(a.CumStats)} {
				out[r] = append(out[r], b...)
			}
		}
		if m.fp8 {
			continue
		}
		outs := make([][]uint16, R)
		errs = g.each(func(r int, e *Engine) error {
			a := args[r]
			// The expert's output: its rows scaled by a per-expert factor (scaled).
			x := make([]uint16, L*RM*H)
			rows := unsafe.Slice((*uint16)(unsafe.Pointer(&a.RecvX[0])), L*RM*H)
			for j := range L {
				copy(x[j*RM*H:], scaled(r*L+j, rows[j*RM*H:(j+1)*RM*H]))
			}
			c := &CombineArgs{Shape: s, NumTokens: in[r].T, NumTopk: K, X: x, SrcInfo: a.SrcInfo,
				LayoutRange: a.LayoutRange, TopkIdx: in[r].topk, TopkWeights: in[r].w, Out: make([]uint16, in[r].T*H)}
			if m.zeroCopy {
				off, err := e.NextCombineBuffer(s)
				if err != nil {
					return err
				}
				copy(unsafe.Slice((*uint16)(at(e.d.Regions[r], off)), L*RM*H), x)
				c.X, c.ZeroCopy = nil, true
			}
			outs[r] = c.Out
			recv, err := e.Combine(c)
			if err != nil {
				return err
			}
			if m.hook {
				time.Sleep(time.Millisecond)
			}
			return recv.Finish()
		})
		for _, err := range errs {
			require.NoError(t, err, "combine of call %d", i)
		}
		for r := range R {
			require.Equal(t, refCombine(in[r], K, L, H, nil, scaled), outs[r], "combine of call %d, rank %d", i, r)
			out[r] = append(out[r], bytesOf(outs[r])...)
		}
	}
	return out
}

// Ranks on other nodes, reached only through remotePut and remoteSignal, receive exactly what
// one node's direct writes deliver.
func TestAcrossNodesMatchesOneNode(t *testing.T) {
	for R := 2; R <= 4; R++ {
		s := Shape{MaxTokens: 5, Hidden: 256, NumExperts: 3 * R}
		want := runCalls(t, newPathGroup(t, R, s, nodes(R, 0, false)), R, s, 4)
		cases := []struct {
			perNode  int
			noNVLink bool
		}{{1, false}, {2, false}, {0, true}, {2, true}}
		for _, c := range cases {
			if c.perNode > 1 && (R%c.perNode != 0 || c.perNode >= R && !c.noNVLink) {
				continue // not a node size of R, or one node
			}
			name := fmt.Sprintf("R=%d nodes of %d, allow_nvlink=%v", R, c.perNode, !c.noNVLink)
			if c.perNode == 0 {
				name = fmt.Sprintf("R=%d one node, allow_nvlink=false", R)
			}
			t.Run(name, func(t *testing.T) {
				g := newPathGroup(t, R, s, nodes(R, c.perNode, c.noNVLink))
				remote := 0
				for r := range R {
					for p := range R {
						if g.engines[r].remote(p) {
							remote++
						}
					}
				}
				require.Positive(t, remote, "some peers take the remote path")
				got := runCalls(t, g, R, s, 4)
				for r := range R {
					require.Equal(t, len(want[r]), len(got[r]), "rank %d", r)
					assert.True(t, string(want[r]) == string(got[r]), "rank %d: outputs differ from one node's", r)
				}
				for _, e := range g.engines {
					for _, puts := range e.puts {
						assert.Empty(t, puts)
					}
				}
			})
		}
	}
}

// A remote put lands only with the next signal to its peer, before the signal's word.
func TestRemotePutLandsWithTheSignal(t *testing.T) {
	s := Shape{MaxTokens: 1, Hidden: 128, NumExperts: 2}
	g := newPathGroup(t, 2, s, nodes(2, 1, false))
	e := g.engines[0]
	l, _ := NewLayout(2, s)
	region := unsafe.Slice((*byte)(g.engines[1].d.Regions[1]), l.TotalBytes)
	a, b := []byte{1, 2, 3, 4}, []byte{5, 6}
	off := l.Recv(0)
	e.write(1, off, a)
	e.write(1, off+8, b)
	assert.Equal(t, make([]byte, 10), region[off:off+10], "nothing lands before the signal")
	e.signal(1, l.DispatchFlags(0), flag(1, 2))
	assert.Equal(t, []byte{1, 2, 3, 4, 0, 0, 0, 0, 5, 6}, region[off:off+10])
	assert.Equal(t, flag(1, 2), g.engines[1].word(1, l.DispatchFlags(0)).Load())
	// Writes to itself and to a peer of its node are direct.
	local := newPathGroup(t, 2, s, nodes(2, 2, false))
	local.engines[0].write(1, off, a)
	assert.Equal(t, a, unsafe.Slice((*byte)(local.engines[1].d.Regions[1]), l.TotalBytes)[off:off+4])
	// A put left without its signal is the engine's bug, reported by the send phase.
	e.write(1, off, b)
	assert.ErrorContains(t, e.unsignalled("low_latency_dispatch"), "1 puts to rank 1 without a signal")
	assert.NoError(t, e.unsignalled("low_latency_dispatch"))
}

func TestPathTableIsChecked(t *testing.T) {
	region := unsafe.Pointer(&make([]byte, 2*align)[0])
	region = unsafe.Add(region, (align-int(uintptr(region))%align)%align)
	d := Domain{Rank: 0, NumRanks: 2, Regions: []unsafe.Pointer{region, region}, NumBytes: HeaderBytes(2)}
	for _, remote := range [][]bool{{false}, {true, true}} {
		d.Remote = remote
		_, err := NewEngine(d)
		assert.ErrorIs(t, err, ErrInvalid)
		assert.ErrorContains(t, err, "path table")
	}
	d.Remote = []bool{false, true}
	_, err := NewEngine(d)
	assert.NoError(t, err)
}
