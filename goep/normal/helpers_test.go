package normal

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// sim simulates an NVLink domain: ranks are goroutines of this process and
// the "shared segments" are ordinary Go memory every rank can see.
type sim struct {
	R        int
	only     int // >= 0: only this rank runs here (one process of a multi-process test)
	numBytes int64
	ctl, buf [][]uint64 // keep the memory alive
	doms     []*Domain
	inCalls  time.Duration // wall time spent inside each()
}

func newSim(t testing.TB, R int, numBytes int64, timeout time.Duration) *sim {
	t.Helper()
	require.True(t, R >= 1 && R <= MaxRanks)
	s := &sim{R: R, numBytes: numBytes, only: -1}
	ctls := make([]unsafe.Pointer, R)
	bufs := make([]unsafe.Pointer, R)
	for r := 0; r < R; r++ {
		c := make([]uint64, ControlBytes/8)
		b := make([]uint64, max(1, (numBytes+7)/8))
		s.ctl, s.buf = append(s.ctl, c), append(s.buf, b)
		ctls[r], bufs[r] = unsafe.Pointer(&c[0]), unsafe.Pointer(&b[0])
	}
	for r := 0; r < R; r++ {
		s.doms = append(s.doms, &Domain{Rank: r, NumRanks: R, Buffers: bufs, Controls: ctls,
			NumBytes: numBytes, Timeout: timeout})
	}
	return s
}

func (s *sim) local(r int) bool { return s.only < 0 || s.only == r }

// each runs f on every (local) rank concurrently and returns the per-rank
// errors.
func (s *sim) each(f func(r int, d *Domain) error) []error {
	errs := make([]error, s.R)
	start := time.Now()
	defer func() { s.inCalls += time.Since(start) }()
	var wg sync.WaitGroup
	for r := 0; r < s.R; r++ {
		if !s.local(r) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r, s.doms[r])
		}()
	}
	wg.Wait()
	return errs
}

func requireNoErrors(t testing.TB, errs []error) {
	t.Helper()
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// scenario describes one dispatch/combine round: shapes, routing and config.
type scenario struct {
	name        string
	R, E, K     int
	tokens      []int // per rank
	hiddenBytes int   // dispatch row bytes (also 2*hidden of the bf16 combine)
	scalesBytes int
	// The dispatch reads the scales column-major, the token stride 1 and the scale stride T plus
	// this padding (DeepGEMM pads to 4 words), as DeepEP does; the reference stays row-major.
	colScales   bool
	colScalePad int
	cfg         Config
	align       int
	worst       int
	noRecvRank  int                                                       // rank none of whose experts is chosen; -1: none
	workers     int                                                       // Domain.Workers
	numBytes    int64                                                     // data region size; 0: what the round needs
	route       func(rng *rand.Rand, sc *scenario, rank, tok int) []int64 // nil: random with -1 entries
}

// rankInput is what one rank dispatches.
type rankInput struct {
	T       int
	x       []byte
	scales  []byte
	topk    []int64
	weights []float32
}

func randomRoute(rng *rand.Rand, sc *scenario, rank, tok int) []int64 {
	row := make([]int64, sc.K)
	epr := sc.E / sc.R
	perm := rng.Perm(sc.E)
	i := 0
	for k := range row {
		if rng.IntN(5) == 0 {
			row[k] = -1
			continue
		}
		for sc.noRecvRank >= 0 && perm[i]/epr == sc.noRecvRank {
			i++
		}
		row[k] = int64(perm[i])
		i++
	}
	return row
}

func makeInputs(rng *rand.Rand, sc *scenario) []rankInput {
	route := sc.route
	if route == nil {
		route = randomRoute
	}
	in := make([]rankInput, sc.R)
	for r := range in {
		T := sc.tokens[r]
		ri := rankInput{T: T, x: make([]byte, T*sc.hiddenBytes), topk: make([]int64, T*sc.K), weights: make([]float32, T*sc.K)}
		for i := range ri.x {
			ri.x[i] = byte(rng.Uint32())
		}
		if sc.scalesBytes > 0 {
			ri.scales = make([]byte, T*sc.scalesBytes)
			for i := range ri.scales {
				ri.scales[i] = byte(rng.Uint32())
			}
		}
		for t := 0; t < T; t++ {
			copy(ri.topk[t*sc.K:], route(rng, sc, r, t))
			for k := 0; k < sc.K; k++ {
				ri.weights[t*sc.K+k] = float32(rng.IntN(1000)+1) / 64
			}
		}
		in[r] = ri
	}
	return in
}

// refRank is the straightforward expectation for one rank.
type refRank struct {
	perRank   []int32
	perExpert []int32
	inRank    []bool
	rpm       []int32
	cpm       []int32
	rcpm      []int32
	recvExp   []int32
	numRecv   int
	recvSrc   []int32 // source rank of every received row
	x, scales []byte
	srcIdx    []int32
	topk      []int64
	weights   []float32
	sendHead  []int32
}

func reference(sc *scenario, in []rankInput) []refRank {
	R, E, K, C := sc.R, sc.E, sc.K, sc.cfg.NumChannels()
	epr := E / R
	align := max(1, sc.align)
	ref := make([]refRank, R)
	for r := range ref {
		T := in[r].T
		rr := &ref[r]
		rr.perRank, rr.perExpert, rr.inRank = make([]int32, R), make([]int32, E), make([]bool, T*R)
		for t := 0; t < T; t++ {
			for _, e := range in[r].topk[t*K : (t+1)*K] {
				if e >= 0 {
					rr.perExpert[e]++
					rr.inRank[t*R+int(e)/epr] = true
				}
			}
			for d := 0; d < R; d++ {
				if rr.inRank[t*R+d] {
					rr.perRank[d]++
				}
			}
		}
		rr.cpm = make([]int32, R*C)
		rr.sendHead = make([]int32, T*R)
		for d := 0; d < R; d++ {
			run := int32(0)
			for c := 0; c < C; c++ {
				lo, hi := channelRange(T, C, c)
				idx := int32(0)
				for t := lo; t < hi; t++ {
					rr.sendHead[t*R+d] = -1
					if rr.inRank[t*R+d] {
						rr.sendHead[t*R+d] = idx
						idx++
					}
				}
				run += idx
				rr.cpm[d*C+c] = run
			}
		}
	}
	rpm := make([]int32, R*R)
	for i := 0; i < R; i++ {
		for j := 0; j < R; j++ {
			rpm[i*R+j] = ref[i].perRank[j]
			if i > 0 {
				rpm[i*R+j] += rpm[(i-1)*R+j]
			}
		}
	}
	for d := range ref {
		rr := &ref[d]
		rr.rpm = rpm
		rr.numRecv = int(rpm[(R-1)*R+d])
		rr.rcpm = make([]int32, R*C)
		rr.recvExp = make([]int32, epr)
		for src := 0; src < R; src++ {
			for c := 1; c < C; c++ {
				rr.rcpm[src*C+c] = ref[src].cpm[d*C+c-1]
			}
			for i := 0; i < epr; i++ {
				rr.recvExp[i] += ref[src].perExpert[d*epr+i]
			}
		}
		for i := range rr.recvExp {
			rr.recvExp[i] = (rr.recvExp[i] + int32(align) - 1) / int32(align) * int32(align)
		}
		rows := rr.numRecv
		if sc.worst > 0 {
			rows = sc.worst
		}
		rr.x = make([]byte, rows*sc.hiddenBytes)
		rr.scales = make([]byte, rows*sc.scalesBytes)
		rr.srcIdx = make([]int32, rows)
		rr.topk = make([]int64, rows*K)
		rr.weights = make([]float32, rows*K)
		for i := range rr.srcIdx {
			rr.srcIdx[i] = -1
		}
		for i := range rr.topk {
			rr.topk[i] = -1
		}
		row := 0
		for src := 0; src < R; src++ {
			for t := 0; t < in[src].T; t++ {
				if !ref[src].inRank[t*R+d] {
					continue
				}
				rr.recvSrc = append(rr.recvSrc, int32(src))
				copy(rr.x[row*sc.hiddenBytes:], in[src].x[t*sc.hiddenBytes:(t+1)*sc.hiddenBytes])
				copy(rr.scales[row*sc.scalesBytes:], in[src].scales[t*sc.scalesBytes:(t+1)*sc.scalesBytes])
				rr.srcIdx[row] = int32(t)
				for k := 0; k < K; k++ {
					e := in[src].topk[t*K+k]
					if e >= 0 && int(e)/epr == d {
						rr.topk[row*K+k] = e - int64(d*epr)
						rr.weights[row*K+k] = in[src].weights[t*K+k]
					}
				}
				row++
			}
		}
	}
	return ref
}

// dispatchOut holds one rank's dispatch outputs.
type dispatchOut struct {
	perRank, perExpert []int32
	inRank             []bool
	rpm, cpm, rcpm     []int32
	recvExp            []int32
	res                NotifyResult
	x, scales          []byte
	srcIdx             []int32
	topk               []int64
	weights            []float32
	rcpm2              []int32
	sendHead           []int32
}

// columnMajor lays out row-major scales [T, S] of 4-byte words column-major, each column padded
// by pad words (garbage there), and returns them with their token and scale strides.
func columnMajor(rows []byte, T, S, pad int) (cols []byte, tokenStride, scaleStride int) {
	ld := T + pad
	cols = make([]byte, 4*max(0, (S-1)*ld+T))
	for i := range cols {
		cols[i] = 0xEE
	}
	for t := 0; t < T; t++ {
		for j := 0; j < S; j++ {
			copy(cols[4*(j*ld+t):4*(j*ld+t+1)], rows[4*(t*S+j):4*(t*S+j+1)])
		}
	}
	return cols, 1, ld
}

// runDispatch runs layout, notify and dispatch on every rank.
func runDispatch(s *sim, sc *scenario, in []rankInput) ([]dispatchOut, []error) {
	R, C, K := sc.R, sc.cfg.NumChannels(), sc.K
	out := make([]dispatchOut, R)
	errs := s.each(func(r int, d *Domain) error {
		o := &out[r]
		T := in[r].T
		o.perRank, o.perExpert, o.inRank = make([]int32, R), make([]int32, sc.E), make([]bool, T*R)
		if err := Layout(in[r].topk, T, K, sc.E, R, o.perRank, o.perExpert, o.inRank); err != nil {
			return err
		}
		o.rpm, o.cpm, o.rcpm, o.recvExp = make([]int32, R*R), make([]int32, R*C), make([]int32, R*C), make([]int32, sc.E/R)
		res, err := Notify(d, &NotifyArgs{Config: sc.cfg, NumTokens: T, NumExperts: sc.E, ExpertAlignment: max(1, sc.align),
			NumWorstTokens: sc.worst, NumTokensPerRank: o.perRank, NumTokensPerExpert: o.perExpert, IsTokenInRank: o.inRank,
			RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.cpm, RecvChannelPrefixMatrix: o.rcpm, NumRecvTokensPerExpert: o.recvExp})
		if err != nil {
			return err
		}
		o.res = res
		rows := res.NumRecvTokens
		if sc.worst > 0 {
			rows = sc.worst
		}
		o.x = make([]byte, rows*sc.hiddenBytes)
		// Garbage in the outputs must be overwritten.
		if len(o.x) > 0 {
			o.x[0] = 0xAB
			for n := 1; n < len(o.x); n *= 2 {
				copy(o.x[n:], o.x[:n])
			}
		}
		if sc.scalesBytes > 0 {
			o.scales = make([]byte, rows*sc.scalesBytes)
		}
		o.srcIdx, o.topk, o.weights = make([]int32, rows), make([]int64, rows*K), make([]float32, rows*K)
		o.rcpm2, o.sendHead = make([]int32, R*C), make([]int32, T*R)
		scales, st, ss := in[r].scales, 0, 0
		if sc.colScales {
			scales, st, ss = columnMajor(in[r].scales, T, sc.scalesBytes/4, sc.colScalePad)
		}
		return Dispatch(d, &DispatchArgs{Config: sc.cfg, NumTokens: T, HiddenBytes: sc.hiddenBytes, ScalesBytes: sc.scalesBytes,
			ScalesTokenStride: st, ScalesStride: ss,
			NumTopk: K, NumExperts: sc.E, X: in[r].x, XScales: scales, TopkIdx: in[r].topk, TopkWeights: in[r].weights,
			IsTokenInRank: o.inRank, RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.cpm, NumWorstTokens: sc.worst,
			RecvX: o.x, RecvXScales: o.scales, RecvSrcIdx: o.srcIdx, RecvTopkIdx: o.topk, RecvTopkWeights: o.weights,
			RecvChannelPrefixMatrix: o.rcpm2, SendHead: o.sendHead})
	})
	return out, errs
}
