package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestRelativeTimeline(t *testing.T) {
	raw := RawLLTimeline{Kernels: []string{"k", "k"}, Phases: []string{"start", "done"},
		Stamps: [][]uint64{{1000, 1500}, {900, 0}, {0, 0}}}
	got := relativeTimeline(raw)
	assert.Equal(t, raw.Kernels, got.Kernels)
	assert.Equal(t, raw.Phases, got.Phases)
	assert.Equal(t, [][]int64{{100, 600}, {0, -1}, {-1, -1}}, got.Stamps, "ns after the earliest, -1 where absent")
	assert.Equal(t, [][]int64{{-1}}, relativeTimeline(RawLLTimeline{Stamps: [][]uint64{{0}}}).Stamps)
}
