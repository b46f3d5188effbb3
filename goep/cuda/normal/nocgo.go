//go:build !cgo

package cudanormal

import (
	"errors"

	"github.com/pyep/pyep/goep"
)

// The engine's launch parameters are kernels/params.h's, which only cgo reads.

// NewEngine is goep.Engines' Normal maker for cuda buffers.
func NewEngine(env goep.EngineEnv) (goep.NormalEngine, error) {
	return nil, errors.New("pyep: normal mode on cuda needs a build with cgo")
}
