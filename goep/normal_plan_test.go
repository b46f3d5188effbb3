package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A planned dispatch is checked as the dispatch it stands for, with the plan's arguments and the
// call's x, scales and weights; a plan serves one call, the one that names its number.
func TestDispatchPlanned(t *testing.T) {
	f := newDispatchFixture(t, 1<<16)
	buf, p, two, one := f.buf, f.p, f.two, f.one
	const bf16, i32, i64, f32, boolean = 3, 6, 7, 0, 12
	none := Desc{NDim: NoneDim}
	plan := func(num int64) {
		buf.PlanDispatch(num, &DispatchArgs{Config: f.cfg, TopkIdx: two(i64, 8, 2), PerRank: one(i32, 4),
			PerExpert: one(i32, 8), InRank: two(boolean, 8, 4), RankPrefix: p, ChannelPrefix: p, RecvChannelPrefix: p,
			RecvPerExpert: p, SendHead: p, Order: StreamOrder{Flags: OrderWait | OrderJoin}},
			RecvTensors{Rows: 32, X: p, SrcIdx: p, TopkIdx: p, TopkWeights: p})
	}

	_, _, err := buf.DispatchPlanned(1, two(bf16, 8, 64), none, two(f32, 8, 2), 1)
	assert.EqualError(t, err, "dispatch: no plan 1 (the buffer's plan is 0)")

	plan(2)
	_, _, err = buf.DispatchPlanned(3, two(bf16, 8, 64), none, two(f32, 8, 2), 1)
	assert.EqualError(t, err, "dispatch: no plan 3 (the buffer's plan is 2)")

	plan(4)
	_, _, err = buf.DispatchPlanned(4, two(bf16, 9, 64), none, two(f32, 9, 2), 1)
	require.Error(t, err)
	assert.True(t, IsArgument(err), "%v", err)
	assert.Contains(t, err.Error(), "is_token_in_rank", "the plan's layout checked against the call's x")

	plan(5)
	_, _, err = buf.DispatchPlanned(5, two(bf16, 8, 64), none, two(f32, 8, 2), 0)
	assert.EqualError(t, err, "expert_alignment = 0: expected an int >= 1")

	plan(6)
	_, _, err = buf.DispatchPlanned(6, two(bf16, 8, 64), none, two(f32, 8, 2), 1)
	require.Error(t, err, "the fixture's buffer has no peers")
	assert.False(t, IsArgument(err), "every argument passed its check: %v", err)
	_, _, err = buf.DispatchPlanned(6, two(bf16, 8, 64), none, two(f32, 8, 2), 1)
	assert.EqualError(t, err, "dispatch: no plan 6 (the buffer's plan is 0)", "a plan serves one call")
}

func TestCombinePlanned(t *testing.T) {
	f := newDispatchFixture(t, 1<<16)
	buf, p, two := f.buf, f.p, f.two
	const bf16, f16, f32 = 3, 2, 0
	none := Desc{NDim: NoneDim}
	plan := func(num int64) {
		buf.PlanCombine(num, &CombineArgs{Config: f.cfg, Bias0: none, Bias1: none, NumTokens: 8,
			NumChannels: f.cfg.NumChannels(), NumRecv: 16, SrcIdx: p, RankPrefix: p, ChannelPrefix: p, SendHead: p,
			CombinedX: p, CombinedTopkWeights: p, Order: StreamOrder{Flags: OrderWait | OrderJoin}})
	}

	assert.EqualError(t, buf.CombinePlanned(1, two(bf16, 16, 64), two(f32, 16, 2)), "combine: no plan 1 (the buffer's plan is 0)")

	plan(2)
	err := buf.CombinePlanned(2, two(bf16, 15, 64), two(f32, 15, 2))
	assert.EqualError(t, err, "x: 15 rows, expected the dispatch's 16 received rows")

	plan(3)
	err = buf.CombinePlanned(3, two(bf16, 16, 64), two(f16, 16, 2))
	require.Error(t, err)
	assert.True(t, IsArgument(err), "%v", err)
	assert.Contains(t, err.Error(), "topk_weights")

	plan(4)
	err = buf.CombinePlanned(4, two(bf16, 16, 64), two(f32, 16, 2))
	require.Error(t, err, "the fixture's buffer has no peers")
	assert.False(t, IsArgument(err), "every argument passed its check: %v", err)
	assert.EqualError(t, buf.CombinePlanned(4, two(bf16, 16, 64), two(f32, 16, 2)), "combine: no plan 4 (the buffer's plan is 0)")
}
