package normal

import (
	"errors"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var protoCfg = Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 2, NumMaxNVLChunkedRecvTokens: 4}

func protoScenario(R int) scenario {
	tokens := make([]int, R)
	for r := range tokens {
		tokens[r] = 40 + 3*r
	}
	return scenario{name: "proto", R: R, E: 4 * R, K: 3, tokens: tokens, hiddenBytes: 64, scalesBytes: 8, cfg: protoCfg, noRecvRank: -1}
}

var protoCombine = combineCase{dtype: BFloat16, hidden: 32, nbias: 1}

// prepared holds a completed dispatch so that tests can issue further calls
// with valid handles.
type prepared struct {
	sc  scenario
	in  []rankInput
	out []dispatchOut
}

func prepare(t *testing.T, s *sim, seed uint64) *prepared {
	t.Helper()
	p := &prepared{sc: protoScenario(s.R)}
	p.in = makeInputs(rand.New(rand.NewPCG(seed, 1)), &p.sc)
	var errs []error
	p.out, errs = runDispatch(s, &p.sc, p.in)
	requireNoErrors(t, errs)
	return p
}

// call issues one operation of the given kind with valid arguments.
func (p *prepared) call(op string, r int, d *Domain) error {
	sc, in, o := &p.sc, &p.in[r], &p.out[r]
	R, C := sc.R, sc.cfg.NumChannels()
	switch op {
	case "barrier":
		return Barrier(d, "test")
	case "notify":
		_, err := Notify(d, &NotifyArgs{Config: sc.cfg, NumTokens: in.T, NumExperts: sc.E, ExpertAlignment: 1,
			NumTokensPerRank: o.perRank, NumTokensPerExpert: o.perExpert, IsTokenInRank: o.inRank,
			RankPrefixMatrix: make([]int32, R*R), ChannelPrefixMatrix: make([]int32, R*C),
			RecvChannelPrefixMatrix: make([]int32, R*C), NumRecvTokensPerExpert: make([]int32, sc.E/R)})
		return err
	case "dispatch":
		return Dispatch(d, p.cachedArgs(r))
	case "combine":
		return Combine(d, p.combineArgs(r))
	}
	panic(op)
}

func (p *prepared) cachedArgs(r int) *DispatchArgs {
	sc, in, o := &p.sc, &p.in[r], &p.out[r]
	rows := len(o.srcIdx)
	return &DispatchArgs{Config: sc.cfg, NumTokens: in.T, HiddenBytes: sc.hiddenBytes, ScalesBytes: sc.scalesBytes,
		X: in.x, XScales: in.scales, IsTokenInRank: o.inRank, RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.cpm,
		RecvX: make([]byte, rows*sc.hiddenBytes), RecvXScales: make([]byte, rows*sc.scalesBytes)}
}

func (p *prepared) combineArgs(r int) *CombineArgs {
	sc, in, o := &p.sc, &p.in[r], &p.out[r]
	H := protoCombine.hidden
	return &CombineArgs{Config: sc.cfg, DType: BFloat16, Hidden: H, NumTopk: sc.K, NumTokens: in.T,
		X: alignedBytes(len(o.srcIdx) * H * 2), TopkWeights: o.weights, SrcIdx: o.srcIdx,
		RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.rcpm2, SendHead: o.sendHead,
		CombinedX: alignedBytes(in.T * H * 2), CombinedTopkWeights: make([]float32, in.T*sc.K)}
}

func protoSim(t *testing.T, R int, timeout time.Duration) *sim {
	sc := protoScenario(R)
	return newSim(t, R, scenarioBytes(&sc, protoCombine), timeout)
}

// goodRound checks that a full round works (after whatever happened before).
func goodRound(t *testing.T, s *sim, seed uint64) {
	t.Helper()
	sc := protoScenario(s.R)
	checkRound(t, s, &sc, protoCombine, seed)
}

func TestRankNeverJoins(t *testing.T) {
	const timeout = 150 * time.Millisecond
	for _, op := range []string{"barrier", "notify", "dispatch", "combine"} {
		t.Run(op, func(t *testing.T) {
			s := protoSim(t, 3, timeout)
			p := prepare(t, s, 1)
			start := time.Now()
			errs := s.each(func(r int, d *Domain) error {
				if r == 2 {
					return nil // never joins
				}
				return p.call(op, r, d)
			})
			elapsed := time.Since(start)
			for r := 0; r < 2; r++ {
				require.Error(t, errs[r], "rank %d", r)
				assert.ErrorIs(t, errs[r], ErrTimeout, "rank %d", r)
				assert.Contains(t, errs[r].Error(), "rank 2 (idle after call", "rank %d", r)
				assert.Contains(t, errs[r].Error(), op, "rank %d", r)
			}
			assert.Less(t, elapsed, 20*timeout)
			// The absent rank simply pairs with the others' next call.
			goodRound(t, s, 2)
			requireNoErrors(t, s.each(func(r int, d *Domain) error { return Barrier(d, "after") }))
		})
	}
}

func TestTimeoutMessages(t *testing.T) {
	const timeout = 150 * time.Millisecond
	s := protoSim(t, 2, timeout)
	errs := s.each(func(r int, d *Domain) error {
		if r == 1 {
			return nil
		}
		return Barrier(d, "tagged")
	})
	require.Error(t, errs[0])
	assert.Equal(t, "barrier(tagged): rank 0: timed out after 150ms waiting for rank 1 (idle) to join call #1", errs[0].Error())
}

// A rank that stalls inside the call (after everybody joined) makes its
// peers time out naming it; afterwards everything works again.
func TestStalledRank(t *testing.T) {
	const timeout = 150 * time.Millisecond
	for _, tc := range []struct {
		where, want string
		op          string
	}{
		{"body", "waiting for rank 2 to announce its token count", "dispatch"},
		{"worker", "waiting for rank 2 to ", "dispatch"},
		{"worker", "waiting for rank 2 to ", "combine"},
		{"body", "waiting for rank 2 to publish its token counts", "notify"},
	} {
		t.Run(tc.op+" "+tc.where, func(t *testing.T) {
			s := protoSim(t, 3, timeout)
			p := prepare(t, s, 3)
			var stalls atomic.Int32
			testHook = func(c *call, where string) {
				if c.me == 2 && where == tc.where && stalls.Add(1) == 1 {
					time.Sleep(4 * timeout)
				}
			}
			errs := s.each(func(r int, d *Domain) error { return p.call(tc.op, r, d) })
			testHook = nil
			for r := 0; r < 3; r++ {
				require.Error(t, errs[r], "rank %d", r)
			}
			// The first rank to time out names rank 2; the others may
			// instead report that rank's failure, which names it too.
			timedOut := 0
			for r := 0; r < 2; r++ {
				assert.Contains(t, errs[r].Error(), "rank 2", "rank %d", r)
				if errors.Is(errs[r], ErrTimeout) {
					timedOut++
					assert.Contains(t, errs[r].Error(), tc.want, "rank %d", r)
				}
			}
			assert.Positive(t, timedOut, "%v", errs)
			goodRound(t, s, 4)
		})
	}
}

// A rank with a bad argument fails the call at once on every rank, with its
// reason, instead of leaving the peers to time out.
func TestPeerRejectsArguments(t *testing.T) {
	s := protoSim(t, 3, 20*time.Second)
	p := prepare(t, s, 5)
	start := time.Now()
	errs := s.each(func(r int, d *Domain) error {
		a := p.cachedArgs(r)
		a.NumTopk, a.NumExperts = p.sc.K, p.sc.E
		a.TopkIdx, a.TopkWeights = append([]int64(nil), p.in[r].topk...), p.in[r].weights
		rows := len(p.out[r].srcIdx)
		a.RecvTopkIdx, a.RecvTopkWeights = make([]int64, rows*p.sc.K), make([]float32, rows*p.sc.K)
		if r == 1 {
			a.TopkIdx[5*p.sc.K+2] = 300
		}
		return Dispatch(d, a)
	})
	assert.Less(t, time.Since(start), 5*time.Second)
	want := "topk_idx[5,2] = 300 is out of range [0, 12)"
	require.Error(t, errs[1])
	assert.ErrorIs(t, errs[1], ErrInvalid)
	assert.Contains(t, errs[1].Error(), want)
	for _, r := range []int{0, 2} {
		require.Error(t, errs[r], "rank %d", r)
		assert.ErrorIs(t, errs[r], ErrPeer, "rank %d", r)
		assert.Contains(t, errs[r].Error(), "rank 1 failed call", "rank %d", r)
		assert.Contains(t, errs[r].Error(), want, "rank %d", r)
	}
	goodRound(t, s, 6)
}

func TestMismatchedCalls(t *testing.T) {
	s := protoSim(t, 2, 20*time.Second)
	p := prepare(t, s, 7)

	errs := s.each(func(r int, d *Domain) error {
		if r == 0 {
			return p.call("barrier", r, d)
		}
		return p.call("notify", r, d)
	})
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.ErrorIs(t, err, ErrPeer)
		assert.Contains(t, err.Error(), "all ranks must make the same sequence of calls")
	}

	errs = s.each(func(r int, d *Domain) error {
		a := p.cachedArgs(r)
		if r == 1 {
			a.HiddenBytes /= 2
			a.X = a.X[:len(a.X)/2]
			a.RecvX = a.RecvX[:len(a.RecvX)/2]
		}
		return Dispatch(d, a)
	})
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "hidden_bytes")
	}
	goodRound(t, s, 8)
}

// A handle from another dispatch is caught by the count exchange.
func TestInconsistentHandle(t *testing.T) {
	s := protoSim(t, 3, 20*time.Second)
	p := prepare(t, s, 9)
	other := prepare(t, s, 10)
	errs := s.each(func(r int, d *Domain) error {
		a := p.combineArgs(r)
		if r == 1 {
			o := &other.out[r]
			a.SendHead, a.NumTokens = o.sendHead, other.in[r].T
			a.CombinedX = alignedBytes(a.NumTokens * a.Hidden * 2)
			a.CombinedTopkWeights = make([]float32, a.NumTokens*a.NumTopk)
		}
		return Combine(d, a)
	})
	require.Error(t, errs[1])
	assert.Contains(t, errs[1].Error(), "send_head expects")
	for r, err := range errs {
		assert.Error(t, err, "rank %d", r)
	}
	goodRound(t, s, 11)
}

func TestNumWorstTokensTooSmall(t *testing.T) {
	s := protoSim(t, 4, 20*time.Second)
	sc := protoScenario(4)
	sc.worst = 10
	in := makeInputs(rand.New(rand.NewPCG(12, 1)), &sc)
	_, errs := runDispatch(s, &sc, in)
	require.Error(t, errs[0])
	assert.ErrorIs(t, errs[0], ErrInvalid)
	assert.Contains(t, errs[0].Error(), "num_worst_tokens = 10 is too small: rank ")
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Equal(t, errs[0].Error(), err.Error(), "rank %d", r)
	}
	goodRound(t, s, 13)
}

func TestBufferTooSmall(t *testing.T) {
	sc := protoScenario(2)
	need := DispatchBufferBytes(sc.cfg, 2, sc.hiddenBytes, sc.scalesBytes, sc.K)
	s := newSim(t, 2, NotifyBufferBytes(2, sc.cfg.NumChannels(), sc.E), 20*time.Second)
	in := makeInputs(rand.New(rand.NewPCG(14, 1)), &sc)
	_, errs := runDispatch(s, &sc, in)
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.ErrorIs(t, err, ErrInvalid)
		assert.Contains(t, err.Error(), "num_nvl_bytes = ")
		assert.Contains(t, err.Error(), "is too small")
		assert.Contains(t, err.Error(), "num_max_nvl_chunked_recv_tokens=4")
		if r == 0 {
			assert.Contains(t, err.Error(), "need "+strconv.FormatInt(need, 10)+" bytes")
		}
	}
	requireNoErrors(t, s.each(func(r int, d *Domain) error { return Barrier(d, "") }))
}

// Many calls in a row on one domain with changing shapes, configs, top-k,
// dtypes and bias counts, interleaved with barriers.
func TestConsecutiveCalls(t *testing.T) {
	const R = 4
	rng := rand.New(rand.NewPCG(15, 15))
	cfgs := []Config{
		{NumSMs: 2, NumMaxNVLChunkedSendTokens: 1, NumMaxNVLChunkedRecvTokens: 2},
		{NumSMs: 4, NumMaxNVLChunkedSendTokens: 3, NumMaxNVLChunkedRecvTokens: 8},
		{NumSMs: 8, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 16},
		{NumSMs: 6, NumMaxNVLChunkedSendTokens: 5, NumMaxNVLChunkedRecvTokens: 7},
	}
	dtypes := []DType{BFloat16, Float16, Float32}
	var rounds []struct {
		sc scenario
		cc combineCase
	}
	var need int64
	iters := 16
	if testing.Short() {
		iters = 6
	}
	for i := 0; i < iters; i++ {
		sc := scenario{name: "seq", R: R, E: R * (1 + rng.IntN(4)), cfg: cfgs[rng.IntN(len(cfgs))],
			hiddenBytes: 1 + rng.IntN(300), scalesBytes: rng.IntN(3) * 4, align: 1 + rng.IntN(3), noRecvRank: -1}
		sc.K = 1 + rng.IntN(min(sc.E, 9))
		sc.tokens = make([]int, R)
		for r := range sc.tokens {
			sc.tokens[r] = rng.IntN(200)
		}
		cc := combineCase{dtype: dtypes[rng.IntN(3)], hidden: 1 + rng.IntN(100), nbias: rng.IntN(3)}
		need = max(need, scenarioBytes(&sc, cc))
		rounds = append(rounds, struct {
			sc scenario
			cc combineCase
		}{sc, cc})
	}
	s := newSim(t, R, need, 20*time.Second)
	for i, rd := range rounds {
		checkRound(t, s, &rd.sc, rd.cc, uint64(100+i))
		if t.Failed() {
			t.Fatalf("round %d failed: %+v %+v", i, rd.sc, rd.cc)
		}
		if i%3 == 0 {
			requireNoErrors(t, s.each(func(r int, d *Domain) error { return Barrier(d, "seq") }))
		}
	}
}

// Ranks that skip calls at random (the others time out) never desynchronise
// the domain: the next call everybody makes works.
func TestRandomAbsences(t *testing.T) {
	const R = 3
	s := protoSim(t, R, 60*time.Millisecond)
	rng := rand.New(rand.NewPCG(16, 16))
	iters := 8
	if testing.Short() {
		iters = 3
	}
	for i := 0; i < iters; i++ {
		absent := rng.IntN(R)
		errs := s.each(func(r int, d *Domain) error {
			if r == absent {
				return nil
			}
			return Barrier(d, "maybe")
		})
		for r, err := range errs {
			if r != absent {
				assert.ErrorIs(t, err, ErrTimeout, "iteration %d rank %d", i, r)
			}
		}
		requireNoErrors(t, s.each(func(r int, d *Domain) error { return Barrier(d, "all") }))
	}
	goodRound(t, s, 17)
}

// A rank that arrives around the moment its peers give up either makes the
// call (everybody succeeds) or is moved to the peers' next call; the ranks
// always agree on which.
func TestLateArrival(t *testing.T) {
	const timeout = 80 * time.Millisecond
	s := protoSim(t, 3, timeout)
	for i, delay := range []float64{0.5, 0.9, 0.97, 1.0, 1.03, 1.1, 1.5, 3} {
		attempts := make([]int, 3)
		errs := s.each(func(r int, d *Domain) error {
			if r == 2 {
				time.Sleep(time.Duration(delay * float64(timeout)))
				return Barrier(d, "late")
			}
			var err error
			for attempts[r] < 10 {
				attempts[r]++
				if err = Barrier(d, "late"); err == nil {
					break
				}
				assert.ErrorIs(t, err, ErrTimeout)
				assert.Contains(t, err.Error(), "rank 2")
			}
			return err
		})
		requireNoErrors(t, errs)
		assert.Equal(t, attempts[0], attempts[1], "iteration %d (delay %.2f)", i, delay)
		if delay >= 3 {
			assert.GreaterOrEqual(t, attempts[0], 2, "a rank that comes after the abort pairs with the next call")
		}
	}
	goodRound(t, s, 18)
}
