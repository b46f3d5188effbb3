//go:build !cgo

package cuda

import (
	"errors"
	"unsafe"

	"github.com/pyep/pyep/goep"
)

// The engines' launch parameters are kernels/params.h's, which only cgo reads.

// NewNormalEngine implements goep.NormalEngines.
func (b *Backend) NewNormalEngine(env goep.EngineEnv) (goep.NormalEngine, error) {
	return nil, errors.New("pyep: normal mode on cuda needs a build with cgo")
}

// NewLowLatencyEngine implements goep.LowLatencyEngines.
func (b *Backend) NewLowLatencyEngine(rank int, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (goep.DeviceLowLatency, error) {
	return nil, errors.New("pyep: low-latency mode on cuda needs a build with cgo")
}
