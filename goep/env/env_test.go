package env

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestParseThreads(t *testing.T) {
	for in, want := range map[string]int{"": 768, "800": 800, " 1024 ": 1024, "1056": 768, "32": 768, "100": 768, "x": 768} {
		assert.Equal(t, want, parseThreads(in, 768), "PYEP_NORMAL_THREADS=%q", in)
	}
}

func TestGetSeesChanges(t *testing.T) {
	t.Setenv(MemHandle, "fd")
	assert.Equal(t, "fd", Get(MemHandle))
}
