package cudanormal

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestShapeFor(t *testing.T) {
	// The measured table, and the base shape elsewhere.
	assert.Equal(t, Shape{896, 4}, ShapeFor(OpDispatch, 2, 0, 0))
	assert.Equal(t, Shape{768, 8}, ShapeFor(OpDispatchFP8, 2, 0, 0))
	assert.Equal(t, Shape{768, 4}, ShapeFor(OpCombine, 2, 0, 0))
	assert.Equal(t, Shape{896, 4}, ShapeFor(OpDispatchCounted, 2, 0, 0))
	assert.Equal(t, Shape{1024, 4}, ShapeFor(OpDispatch, 4, 0, 0))
	assert.Equal(t, Shape{768, 8}, ShapeFor(OpDispatchCounted, 4, 0, 0))
	assert.Equal(t, Shape{512, 8}, ShapeFor(OpCombine, 4, 0, 0))
	assert.Equal(t, Shape{768, 8}, ShapeFor(OpCombine, 8, 0, 0))
	// The options replace either part, for every op.
	assert.Equal(t, Shape{640, 4}, ShapeFor(OpDispatch, 2, 640, 0))
	assert.Equal(t, Shape{512, 2}, ShapeFor(OpCombine, 4, 0, 2))
	assert.Equal(t, Shape{128, 16}, ShapeFor(OpDispatchFP8, 2, 128, 16))
	// A warp for each rank and one more.
	assert.Equal(t, Shape{288, 8}, ShapeFor(OpDispatch, 8, 64, 0))
}

func TestDispatchDefinesSplitSend(t *testing.T) {
	// Rows with scales (FP8): both blocks of a channel send; rows without: one block sends.
	s := ShapeFor(OpDispatchFP8, 2, 0, 0)
	assert.Equal(t, "1", DispatchDefines(2, 7168, 224, 8, 16, s)["PYEP_SPLIT_SEND"])
	assert.Equal(t, "1", NotifyDispatchDefines(2, 7168, 224, 8, 16, s)["PYEP_SPLIT_SEND"])
	s = ShapeFor(OpDispatch, 2, 0, 0)
	assert.Equal(t, "0", DispatchDefines(2, 14336, 0, 8, 16, s)["PYEP_SPLIT_SEND"])
	assert.Equal(t, "0", NotifyDispatchDefines(2, 14336, 0, 0, 16, s)["PYEP_SPLIT_SEND"])
}

func TestCombineDefinesBiases(t *testing.T) {
	// The kernel is compiled for the biases the call adds: bit 0 bias_0, bit 1 bias_1.
	s := ShapeFor(OpCombine, 2, 0, 0)
	for _, c := range []struct {
		b0, b1 uint64
		want   string
	}{{0, 0, "0"}, {0x1000, 0, "1"}, {0, 0x2000, "2"}, {0x1000, 0x2000, "3"}} {
		assert.Equal(t, c.want, CombineDefines(2, 7168, 1, 8, combineBiases(c.b0, c.b1), 16, s)["PYEP_BIASES"])
	}
}
