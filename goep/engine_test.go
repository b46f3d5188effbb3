package goep

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeEngine records its Close.
type fakeEngine struct {
	NormalEngine
	closed *int
}

func (f fakeEngine) Close() error { *f.closed++; return nil }

// memoryless is a Backend without engines or memory.
type memoryless struct{ gpuBackend }

func (memoryless) Name() string { return "memoryless" }

// A buffer makes its engine once, through Params.Engines before the backend's own, hands it
// the buffer's ranks, and Destroy closes it; a destroyed buffer makes none.
func TestBufferEngines(t *testing.T) {
	closed, made := 0, 0
	var env EngineEnv
	maker := func(e EngineEnv) (NormalEngine, error) {
		made++
		env = e
		return fakeEngine{closed: &closed}, nil
	}
	b, err := NewBuffer(Params{Rank: 1, NumRanks: 2, Engines: Engines{Normal: maker}}, memoryless{})
	require.NoError(t, err)
	e1, err := b.NormalEngine()
	require.NoError(t, err)
	e2, err := b.NormalEngine()
	require.NoError(t, err)
	assert.Equal(t, e1, e2)
	assert.Equal(t, 1, made)
	assert.Equal(t, 1, env.Topo.Rank)
	require.NoError(t, b.Destroy())
	assert.Equal(t, 1, closed)
	_, err = b.NormalEngine()
	assert.ErrorIs(t, err, errDestroyed)

	b, err = NewBuffer(Params{Rank: 0, NumRanks: 1}, memoryless{})
	require.NoError(t, err)
	_, err = b.NormalEngine()
	assert.EqualError(t, err, "normal mode is not available on the memoryless backend")
	assert.False(t, errors.Is(err, errDestroyed))
}
