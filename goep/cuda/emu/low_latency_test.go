//go:build cgo

package emu_test

import (
	"fmt"
	"math/rand"
	"os"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
	"github.com/pyep/pyep/goep/cuda/emu"
	cudall "github.com/pyep/pyep/goep/cuda/lowlatency"
	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/lowlatency"
)

// Low-latency mode's kernels (kernels/low_latency.cu) emulated on the host against
// goep/lowlatency, the cpu reference: every output bit for bit, over several calls (both halves,
// hooks) on one set of regions.

type llRank struct {
	drv *fake.Driver
	be  *cuda.Backend
	ll  *cudall.Engine
	env *rankEnv
}

// remoteOf is which peers a rank reaches through kernels/remote.cuh: those of other nodes of
// perNode ranks (0: one node), or with noNVLink every other rank (nil: none).
func remoteOf(R, perNode int, noNVLink bool) func(r int) []bool {
	if perNode == 0 && !noNVLink {
		return func(int) []bool { return nil }
	}
	return func(r int) []bool {
		remote := make([]bool, R)
		for p := range remote {
			remote[p] = p != r && (noNVLink || perNode > 0 && p/perNode != r/perNode)
		}
		return remote
	}
}

// newLLDomain makes the engines of R ranks on fake GPUs; remote(r) are rank r's remote peers,
// which its kernels reach through the emulated remote_put/remote_signal.
func newLLDomain(t *testing.T, R int, numBytes int64, remote func(r int) []bool) []*llRank {
	t.Helper()
	w := fake.NewWorld()
	ranks := make([]*llRank, R)
	locals := make([]interface{ Token() []byte }, R)
	tokens := make([][]byte, R)
	for r := range ranks {
		d := fake.New(fake.Config{World: w, Devices: 8, MemBytes: 1 << 30, Guard: os.Getenv("PYEP_EMU_NOGUARD") == ""})
		be, err := cuda.NewBackend(d, r, cuda.BackendOptions{Timeout: 20 * time.Second, NVLink: allLinks{}, Process: fmt.Sprint("rank", r)})
		require.NoError(t, err)
		o := emu.Options()
		o.LowLatencyThreads, o.LowLatencyBlocks = 64, 2
		be.SetNormalOptions(o)
		l, err := be.Allocate(numBytes, R-1)
		require.NoError(t, err)
		locals[r], tokens[r] = l, l.Token()
		ranks[r] = &llRank{drv: d, be: be, env: &rankEnv{r: r, drv: d, be: be}}
		t.Cleanup(func() { assert.NoError(t, l.Close()) })
	}
	for r, k := range ranks {
		regions := make([]unsafe.Pointer, R)
		reach := &cudall.Reach{Remote: remote(r), Names: make([]uint64, R)}
		for p := range R {
			if p == r {
				regions[p] = locals[p].(interface{ Data() unsafe.Pointer }).Data()
				continue
			}
			reg, err := k.be.Open(tokens[p], numBytes)
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, reg.Close()) })
			regions[p] = reg.Data()
			if reach.Remote != nil && reach.Remote[p] {
				// The kernels see the peer only by its name, as NVSHMEM's symmetric address on a GPU.
				reach.Names[p], regions[p] = emu.RemoteName(reg.Data()), nil
			}
		}
		var err error
		k.ll, err = cudall.New(k.be, r, regions, numBytes, 1, reach)
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, k.ll.Close()) })
	}
	return ranks
}

// refLL is goep/lowlatency's engines over host memory, with the same remote peers.
func refLL(t *testing.T, R int, numBytes int64, remote func(r int) []bool) []*lowlatency.Engine {
	regions := make([]unsafe.Pointer, R)
	for r := range regions {
		b := make([]uint64, numBytes/8+16)
		p := uintptr(unsafe.Pointer(&b[0]))
		regions[r] = unsafe.Pointer(&b[(128-p%128)%128/8])
	}
	out := make([]*lowlatency.Engine, R)
	for r := range out {
		e, err := lowlatency.NewEngine(lowlatency.Domain{Rank: r, NumRanks: R, Regions: regions, NumBytes: numBytes,
			Timeout: 20 * time.Second, Remote: remote(r)})
		require.NoError(t, err)
		out[r] = e
	}
	return out
}

type llCase struct {
	R, T, H, K, E, M        int
	fp8, round, ue8m0, hook bool
	logfmt                  bool // the combine's rows in LogFMT-10
	// perNode: ranks per (emulated) node, 0 for one node; noNVLink: every peer remote
	// (allow_nvlink_for_low_latency_mode=False).
	perNode  int
	noNVLink bool
	// routing: "" random (a fifth of the choices -1); "packed": a token's choices all experts of
	// one rank (min(K, L) of them, the rest -1); "dupes": random, and a third of the choices repeat
	// an earlier one of the token (the reference, which refuses repeats, gets -1 there).
	routing string
	// drop: 1 + a rank that every other rank masks (enable_shrink) and that makes no call; 0: none.
	drop int
	// clean: clean_low_latency_buffer on every rank after the first round (the calls start again at seq 1).
	clean bool
	// skip: 1 + a round with no combine, so that the next round's dispatch runs on the half of the
	// combine before it (a half's calls are not all of one kind); 0: none.
	skip int
}

func (c llCase) String() string {
	s := fmt.Sprintf("R%d_H%d_fp8=%v_ue8m0=%v_hook=%v", c.R, c.H, c.fp8, c.ue8m0, c.hook)
	if c.perNode > 0 {
		s += fmt.Sprintf("_nodes_of_%d", c.perNode)
	}
	if c.noNVLink {
		s += "_no_nvlink"
	}
	if c.routing != "" {
		s += "_" + c.routing
	}
	if c.drop > 0 {
		s += fmt.Sprintf("_rank%d_masked", c.drop-1)
	}
	if c.clean {
		s += "_clean"
	}
	if c.logfmt {
		s += "_logfmt"
	}
	if c.skip > 0 {
		s += fmt.Sprintf("_no_combine_in_round%d", c.skip-1)
	}
	return s
}

func (c llCase) inputs(r, call int) (x []uint16, idx []int64, w []float32) {
	rng := rand.New(rand.NewSource(int64(1000*r + call + 7)))
	T := c.T - r%2 // ranks send different token counts
	x = make([]uint16, T*c.H)
	for i := range x {
		x[i] = uint16(rng.Intn(1<<15))&0x3fff | uint16(rng.Intn(2))<<15 // finite bf16 values of both signs
	}
	idx = make([]int64, T*c.K)
	w = make([]float32, T*c.K)
	L := c.E / c.R
	for t := range T {
		perm := rng.Perm(c.E)
		for k := range c.K {
			switch {
			case c.routing == "packed":
				idx[t*c.K+k] = -1 // below
			case c.routing == "dupes" && k > 0 && rng.Intn(3) == 0:
				idx[t*c.K+k] = idx[t*c.K+rng.Intn(k)]
			default:
				idx[t*c.K+k] = int64(perm[k])
				if rng.Intn(5) == 0 {
					idx[t*c.K+k] = -1
				}
			}
			w[t*c.K+k] = rng.Float32()
		}
		if c.routing == "packed" {
			d := rng.Intn(c.R)
			for k, j := range rng.Perm(L)[:min(c.K, L)] {
				idx[t*c.K+k] = int64(d*L + j)
			}
		}
	}
	return x, idx, w
}

// once is idx with every repeat of an expert within a token -1: what the kernels send (a token
// reaches an expert once), and what the reference, which refuses repeats, is given.
func (c llCase) once(idx []int64) []int64 {
	out := slices.Clone(idx)
	for i, g := range out {
		if g >= 0 && slices.Contains(out[i-i%c.K:i], g) {
			out[i] = -1
		}
	}
	return out
}

func TestEmulatedLowLatency(t *testing.T) {
	for _, c := range []llCase{
		{R: 2, T: 6, H: 256, K: 3, E: 8, M: 8},
		{R: 2, T: 6, H: 384, K: 3, E: 8, M: 8, fp8: true},
		{R: 3, T: 5, H: 256, K: 2, E: 6, M: 6, fp8: true, round: true, ue8m0: true, hook: true},
		// more tokens than a block has threads (64): the send lists them in two rounds; 640 channels
		// end in half a chunk and five scales (UE8M0 words of 4 + 1).
		{R: 2, T: 70, H: 640, K: 4, E: 4, M: 80, fp8: true, round: true, ue8m0: true},
		// the send's other paths: rank 1 has no token (every flag comes from the experts that no token
		// selected), and each of 2 blocks asks about its 20 of 40 experts in two rounds (16 a round).
		{R: 2, T: 1, H: 128, K: 1, E: 40, M: 4},
		{R: 2, T: 3, H: 128, K: 1, E: 40, M: 4, fp8: true},
		// 11 of 12 experts a token: each token's message goes to every rank several times, and a
		// batch's 88 selections outnumber the block's threads.
		{R: 3, T: 9, H: 256, K: 11, E: 12, M: 9, fp8: true, round: true},
		// more (expert, source) pairs than a block holds the counts of (4 a thread): the receive
		// that deals pairs to blocks in batches instead of balancing rows.
		{R: 2, T: 6, H: 128, K: 3, E: 264, M: 8, fp8: true},
		// a round with no combine: the dispatches after it find halves that a combine used last (the
		// dispatch's done words count its own calls on a half, not the half's calls).
		{R: 2, T: 6, H: 256, K: 3, E: 8, M: 8, fp8: true, skip: 2},
		{R: 3, T: 5, H: 256, K: 2, E: 6, M: 6, hook: true, skip: 1},
		{R: 2, T: 6, H: 128, K: 3, E: 264, M: 8, skip: 2},
	} {
		t.Run(c.String(), func(t *testing.T) { runLL(t, c) })
	}
}

// LogFMT-10 rows (use_logfmt): the kernels' codec against the reference's, bit for bit, through
// peers written directly, hooks, a half chunk at the end (640 channels: five groups), tokens that
// select several experts of a rank (a partial sum crosses), and peers reached through puts.
func TestEmulatedLowLatencyLogFMT(t *testing.T) {
	for _, c := range []llCase{
		{R: 2, T: 6, H: 256, K: 3, E: 8, M: 8, logfmt: true},
		{R: 3, T: 5, H: 640, K: 4, E: 6, M: 6, fp8: true, hook: true, logfmt: true},
		{R: 3, T: 6, H: 256, K: 8, E: 12, M: 8, routing: "packed", logfmt: true},
		{R: 4, T: 5, H: 384, K: 3, E: 8, M: 6, perNode: 2, logfmt: true},
		{R: 3, T: 6, H: 256, K: 4, E: 6, M: 8, hook: true, noNVLink: true, logfmt: true},
	} {
		t.Run(c.String(), func(t *testing.T) { runLL(t, c) })
	}
}

// The message format (a message a token and destination rank, expanded by the receiver into a row
// an entry of its header): tokens that choose many experts of one rank, repeats, a rank that every
// other masks, headers left by the calls before a clean (whose seq the calls after it reuse), a
// rank of one expert (the smallest header), and more messages than a block holds the sums of (the
// receive in rounds).
func TestEmulatedLowLatencyMessages(t *testing.T) {
	for _, c := range []llCase{
		{R: 2, T: 6, H: 256, K: 11, E: 24, M: 8, fp8: true, routing: "packed"},
		{R: 3, T: 6, H: 256, K: 8, E: 12, M: 8, routing: "packed"},
		{R: 2, T: 6, H: 384, K: 6, E: 8, M: 8, fp8: true, round: true, ue8m0: true, routing: "dupes"},
		{R: 3, T: 6, H: 256, K: 4, E: 6, M: 8, fp8: true, drop: 2},
		{R: 2, T: 6, H: 256, K: 3, E: 8, M: 8, hook: true, clean: true, routing: "packed"},
		{R: 2, T: 6, H: 128, K: 2, E: 2, M: 8},
		{R: 2, T: 5, H: 128, K: 3, E: 8, M: 300, routing: "packed"},
		{R: 4, T: 5, H: 256, K: 6, E: 16, M: 6, fp8: true, perNode: 2, routing: "packed"},
		{R: 3, T: 6, H: 256, K: 4, E: 6, M: 8, hook: true, noNVLink: true, routing: "dupes"},
		{R: 2, T: 5, H: 128, K: 3, E: 8, M: 300, perNode: 1, routing: "packed"},
	} {
		t.Run(c.String(), func(t *testing.T) { runLL(t, c) })
	}
}

// Across nodes (hybrid): the peers of other nodes are reached through the emulated NVSHMEM pair,
// those of this rank's node directly, and every output is still bit for bit the reference's,
// which writes the same peers through its own remote path.
func TestEmulatedLowLatencyAcrossNodes(t *testing.T) {
	for _, c := range []llCase{
		{R: 2, T: 6, H: 256, K: 2, E: 8, M: 8, perNode: 1},
		{R: 4, T: 5, H: 384, K: 3, E: 8, M: 6, fp8: true, perNode: 2},
		{R: 4, T: 5, H: 256, K: 3, E: 8, M: 6, fp8: true, round: true, ue8m0: true, hook: true, perNode: 2},
		{R: 3, T: 6, H: 256, K: 2, E: 6, M: 8, hook: true, noNVLink: true},
		// two rounds of tokens a block (64 threads): the puts of a round read its lists before the next
		{R: 2, T: 70, H: 640, K: 4, E: 4, M: 80, fp8: true, perNode: 1},
	} {
		t.Run(c.String(), func(t *testing.T) { runLL(t, c) })
	}
}

// runLL runs the case's calls on the emulated GPUs and checks them against the reference; after,
// if given, runs after each checked dispatch and combine (with the ranks' engines).
func runLL(t *testing.T, c llCase, after ...func(gpu []*llRank, combine bool)) {
	shape := lowlatency.Shape{MaxTokens: c.M, Hidden: c.H, NumExperts: c.E}
	size, err := lowlatency.SizeHint(c.R, shape)
	require.NoError(t, err)
	remote := remoteOf(c.R, c.perNode, c.noNVLink)
	gpu := newLLDomain(t, c.R, size, remote)
	ref := refLL(t, c.R, size, remote)
	L, RM := c.E/c.R, c.R*c.M
	rowBytes, S := 2*c.H, c.H/lowlatency.ScaleBlock
	if c.fp8 {
		rowBytes = c.H
	}
	if c.ue8m0 {
		S = (S + 3) / 4
	}
	// The ranks that call: all but c.drop's, which every other rank masks.
	calling := func(f func(r int) error) []error {
		return each(c.R, func(r int) error {
			if r == c.drop-1 {
				return nil
			}
			return f(r)
		})
	}
	if c.drop > 0 {
		for r := range c.R {
			if r != c.drop-1 {
				require.NoError(t, gpu[r].ll.SetMask(c.drop-1, true))
				require.NoError(t, ref[r].SetMask(c.drop-1, true))
			}
		}
	}
	// Three rounds of dispatch + combine: calls 1..6, both halves twice and more.
	for round := range 3 {
		if c.clean && round == 1 {
			noErrors(t, calling(func(r int) error { return ref[r].Clean(shape) }))
			for r := range c.R {
				require.NoError(t, gpu[r].ll.Clean(shape, false))
			}
		}
		type outs struct {
			recv, scales, src, rng, cnt []byte
			out                         []byte
		}
		got := make([]outs, c.R)
		want := make([]outs, c.R)
		// Reference.
		refArgs := make([]*lowlatency.DispatchArgs, c.R)
		noErrors(t, calling(func(r int) error {
			x, idx, _ := c.inputs(r, round)
			idx = c.once(idx)
			a := &lowlatency.DispatchArgs{Shape: shape, NumTokens: len(idx) / c.K, NumTopk: c.K, X: x, TopkIdx: idx,
				UseFP8: c.fp8, RoundScale: c.round, UseUE8M0: c.ue8m0, RecvX: make([]byte, L*RM*rowBytes),
				SrcInfo: make([]int32, L*RM), LayoutRange: make([]int64, L*c.R), Count: make([]int32, L)}
			if c.fp8 {
				a.RecvScales = make([]uint32, L*RM*S)
			}
			refArgs[r] = a
			rv, err := ref[r].Dispatch(a)
			if err != nil {
				return err
			}
			return rv.Finish()
		}))
		// Emulated GPU.
		type devArgs struct{ x, idx, w, recv, scales, src, rng, cnt, out dev }
		da := make([]devArgs, c.R)
		noErrors(t, calling(func(r int) error {
			g := gpu[r].env
			x, idx, w := c.inputs(r, round)
			T := len(idx) / c.K
			d := devArgs{x: g.upload(t, dlpack.BF16, bytesOf(x), int64(T), int64(c.H)),
				idx:  g.upload(t, dlpack.I64, bytesOf(idx), int64(T), int64(c.K)),
				w:    g.upload(t, dlpack.F32, bytesOf(w), int64(T), int64(c.K)),
				recv: g.alloc(t, dlpack.FP8E4M3, int64(L*RM*rowBytes)), src: g.alloc(t, dlpack.I32, int64(L*RM)),
				rng: g.alloc(t, dlpack.I64, int64(L*c.R)), cnt: g.alloc(t, dlpack.I32, int64(L)),
				out: g.alloc(t, dlpack.BF16, int64(max(T, 1)), int64(c.H))}
			if c.fp8 {
				d.scales = g.alloc(t, dlpack.I32, int64(L*RM*S))
			}
			da[r] = d
			call := &goep.LLCall{Shape: shape, NumTokens: T, NumTopk: c.K, UseFP8: c.fp8, RoundScale: c.round, UseUE8M0: c.ue8m0,
				X: addr(d.x), TopkIdx: addr(d.idx), RecvX: addr(d.recv), RecvScales: addr(d.scales), SrcInfo: addr(d.src),
				LayoutRange: addr(d.rng), Count: addr(d.cnt), Hook: c.hook}
			rv, err := gpu[r].ll.Launch(false, call)
			if err != nil || rv == nil {
				return err
			}
			return rv.Finish(0)
		}))
		for r := range c.R {
			if r == c.drop-1 {
				continue
			}
			a := refArgs[r]
			d := da[r]
			require.Equal(t, i32s(bytesOf(a.Count)), i32s(d.cnt.b), "rank %d round %d: count", r, round)
			require.Equal(t, i64s(bytesOf(a.LayoutRange)), i64s(d.rng.b), "rank %d round %d: layout_range", r, round)
			for j := range L {
				n := int(a.Count[j])
				base := j * RM
				assert.Equal(t, a.SrcInfo[base:base+n], i32s(d.src.b)[base:base+n], "rank %d expert %d: src_info", r, j)
				assert.Equal(t, a.RecvX[base*rowBytes:(base+n)*rowBytes], d.recv.b[base*rowBytes:(base+n)*rowBytes], "rank %d expert %d: recv_x", r, j)
				if c.fp8 && n > 0 {
					for s := range S {
						off := (j*S + s) * RM
						assert.Equal(t, bytesOf(a.RecvScales[off:off+n]), d.scales.b[4*off:4*(off+n)], "rank %d expert %d scale %d", r, j, s)
					}
				}
			}
			_ = got
			_ = want
		}
		for _, f := range after {
			f(gpu, false)
		}
		if round == c.skip-1 {
			continue
		}
		// Combine the dispatched rows (as bf16: for FP8 the recv rows reinterpreted are as good as any data).
		outRef := make([][]uint16, c.R)
		noErrors(t, calling(func(r int) error {
			_, idx, w := c.inputs(r, round)
			idx = c.once(idx)
			T := len(idx) / c.K
			rows := make([]uint16, L*RM*c.H)
			for i := range rows {
				rows[i] = uint16((i*7 + r*13 + round) % 9000)
			}
			outRef[r] = make([]uint16, T*c.H)
			a := &lowlatency.CombineArgs{Shape: shape, NumTokens: T, NumTopk: c.K, X: rows, SrcInfo: refArgs[r].SrcInfo,
				LayoutRange: refArgs[r].LayoutRange, TopkIdx: idx, TopkWeights: w, Out: outRef[r], LogFMT: c.logfmt}
			rv, err := ref[r].Combine(a)
			if err != nil {
				return err
			}
			return rv.Finish()
		}))
		calls := make([]*goep.LLCall, c.R)
		noErrors(t, calling(func(r int) error {
			g := gpu[r].env
			_, idx, _ := c.inputs(r, round)
			T := len(idx) / c.K
			// The combine sums a token's choices as the reference does, which has no repeats.
			cidx := g.upload(t, dlpack.I64, bytesOf(c.once(idx)), int64(T), int64(c.K))
			rows := make([]uint16, L*RM*c.H)
			for i := range rows {
				rows[i] = uint16((i*7 + r*13 + round) % 9000)
			}
			x := g.upload(t, dlpack.BF16, bytesOf(rows), int64(len(rows)))
			calls[r] = &goep.LLCall{Shape: shape, NumTokens: T, NumTopk: c.K, X: addr(x), TopkIdx: addr(cidx),
				TopkWeights: addr(da[r].w), SrcInfo: addr(da[r].src), LayoutRange: addr(da[r].rng), Out: addr(da[r].out), Hook: c.hook,
				LogFMT: c.logfmt}
			return nil
		}))
		// Hooked, the send phases run one rank after another (the emulator runs a kernel when it is
		// launched), so a rank's send finds the pushes of the ranks before it only and defers the
		// others' rows to its hook; then the hooks.
		recvs := make([]goep.LLReceive, c.R)
		for r := range c.R {
			if c.hook && r != c.drop-1 {
				var err error
				recvs[r], err = gpu[r].ll.Launch(true, calls[r])
				require.NoError(t, err, "rank %d round %d: hooked combine send", r, round)
			}
		}
		noErrors(t, calling(func(r int) error {
			rv := recvs[r]
			if !c.hook {
				var err error
				if rv, err = gpu[r].ll.Launch(true, calls[r]); err != nil {
					return err
				}
			}
			if rv == nil {
				return nil
			}
			return rv.Finish(0)
		}))
		for r := range c.R {
			n := len(outRef[r]) * 2
			if r == c.drop-1 {
				continue
			}
			if n == 0 {
				continue // a rank without tokens combines nothing
			}
			assert.Equal(t, bytesOf(outRef[r]), da[r].out.b[:n], "rank %d round %d: combined", r, round)
		}
		for _, f := range after {
			f(gpu, true)
		}
	}
}

func addr(d dev) uintptr {
	if !d.t.Valid {
		return 0
	}
	return uintptr(d.t.Data)
}
