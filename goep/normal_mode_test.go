package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/dlpack"
)

func TestScaleStrides(t *testing.T) {
	cases := []struct {
		name           string
		shape, strides []int64
		st, ss         int64
		err            string
	}{
		{name: "dense", shape: []int64{5, 3}, st: 3, ss: 1},
		{name: "column-major", shape: []int64{5, 3}, strides: []int64{1, 5}, st: 1, ss: 5},
		{name: "TMA-padded column-major", shape: []int64{5, 3}, strides: []int64{1, 8}, st: 1, ss: 8},
		{name: "padded rows", shape: []int64{5, 3}, strides: []int64{4, 1}, st: 4, ss: 1},
		{name: "one token of column-major", shape: []int64{1, 3}, strides: []int64{1, 8}, st: 1, ss: 8},
		{name: "one scale, rows apart", shape: []int64{5, 1}, strides: []int64{2, 9}, st: 2, ss: 1},
		{name: "overlapping columns", shape: []int64{5, 3}, strides: []int64{1, 4}, err: "expected row-major (3, 1) or column-major (1, 5)"},
		{name: "both strided", shape: []int64{5, 3}, strides: []int64{2, 10}, err: "strides [2 10] for shape [5 3]"},
		{name: "broadcast", shape: []int64{5, 3}, strides: []int64{0, 1}, err: "x_scales: strides [0 1]"},
		{name: "stride past int32", shape: []int64{5, 3}, strides: []int64{1, 1 << 31}, err: "up to 2147483647"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			st, ss, err := scaleStrides(dlpack.Tensor{Valid: true, DType: dlpack.F32, Shape: c.shape, Strides: c.strides})
			if c.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), c.err)
				assert.True(t, IsArgument(err))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, [2]int64{c.st, c.ss}, [2]int64{st, ss})
		})
	}
}
