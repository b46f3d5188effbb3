package env

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseThreads(t *testing.T) {
	for in, want := range map[string]int{"": 768, "800": 800, " 1024 ": 1024, "1056": 768, "32": 768, "100": 768, "x": 768} {
		assert.Equal(t, want, parseThreads(in, 768), "PYEP_NORMAL_THREADS=%q", in)
	}
}

func TestParseUnroll(t *testing.T) {
	for in, want := range map[string]int{"": 0, "1": 1, " 4 ": 4, "16": 16, "17": 0, "0": 0, "-2": 0, "x": 0} {
		assert.Equal(t, want, parseUnroll(in), "PYEP_COPY_UNROLL=%q", in)
	}
}

func TestGetSeesChanges(t *testing.T) {
	t.Setenv(MemHandle, "fd")
	assert.Equal(t, "fd", Get(MemHandle))
}

func TestNodeSize(t *testing.T) {
	for in, want := range map[string]int{"": 0, "  ": 0, "1": 1, " 2 ": 2, "8": 8, "16": 16} {
		n, err := parseNodeSize(in)
		require.NoError(t, err, "PYEP_RANKS_PER_NODE=%q", in)
		assert.Equal(t, want, n, "PYEP_RANKS_PER_NODE=%q", in)
	}
	for _, in := range []string{"0", "-2", "two", "2.5", "2x"} {
		_, err := parseNodeSize(in)
		require.Error(t, err, "PYEP_RANKS_PER_NODE=%q", in)
		assert.Contains(t, err.Error(), "PYEP_RANKS_PER_NODE=")
		assert.Contains(t, err.Error(), "expected a positive whole number")
	}
	t.Setenv(RanksPerNode, "4")
	n, err := NodeSize()
	require.NoError(t, err)
	assert.Equal(t, 4, n)
	t.Setenv(RanksPerNode, "")
	n, err = NodeSize()
	require.NoError(t, err)
	assert.Zero(t, n)
}

func TestTimeline(t *testing.T) {
	for in, want := range map[string]bool{"": false, "0": false, "yes": false, "1": true} {
		t.Setenv(LLTimeline, in)
		assert.Equal(t, want, Timeline(), "PYEP_LL_TIMELINE=%q", in)
	}
}

func TestCommStreamOnly(t *testing.T) {
	for in, want := range map[string]bool{"": false, "0": false, "true": false, "1": true} {
		t.Setenv(CommStream, in)
		assert.Equal(t, want, CommStreamOnly(), "PYEP_COMM_STREAM=%q", in)
	}
}
