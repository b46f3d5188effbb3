//go:build !cgo

package cuda

import (
	"errors"

	"github.com/pyep/pyep/goep"
)

// NewNormalEngine implements goep.NormalEngines; the engine's launch parameters are
// kernels/params.h's, which only cgo reads.
func (b *Backend) NewNormalEngine(env goep.EngineEnv) (goep.NormalEngine, error) {
	return nil, errors.New("pyep: normal mode on cuda needs a build with cgo")
}
