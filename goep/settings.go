package goep

import (
	"sync/atomic"
	"time"

	"github.com/pyep/pyep/goep/env"
)

// DefaultTimeout bounds every wait on a peer unless PYEP_TIMEOUT_S or SetOpTimeout says
// otherwise: DeepEP's kernel timeout (about 100 s).
const DefaultTimeout = 100 * time.Second

// opTimeout is the bound of every wait on a peer, host or kernel: PYEP_TIMEOUT_S seconds (read
// at start-up), DefaultTimeout by default, or what SetOpTimeout set.
var opTimeout atomic.Int64

func init() {
	d := DefaultTimeout
	if t, ok := env.Timeout(); ok {
		d = t
	}
	opTimeout.Store(int64(d))
}

// OpTimeout is the bound of every wait on a peer, for calls made now.
func OpTimeout() time.Duration { return time.Duration(opTimeout.Load()) }

// SetOpTimeout changes the bound of the waits on peers for calls made from now on; d <= 0
// changes nothing.
func SetOpTimeout(d time.Duration) {
	if d > 0 {
		opTimeout.Store(int64(d))
	}
}
