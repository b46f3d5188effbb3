//go:build !cgo

package cudall

import (
	"errors"
	"unsafe"

	"github.com/pyep/pyep/goep"
)

// The engine's launch parameters are kernels/params.h's, which only cgo reads.

// NewEngine is goep.Engines' LowLatency maker for cuda buffers.
func NewEngine(env goep.EngineEnv, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (goep.DeviceLowLatency, error) {
	return nil, errors.New("pyep: low-latency mode on cuda needs a build with cgo")
}
