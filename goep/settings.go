package goep

import (
	"os"
	"strconv"
	"sync/atomic"
	"time"
)

// DefaultTimeout bounds every wait on a peer unless PYEP_TIMEOUT_S or SetOpTimeout says
// otherwise: DeepEP's kernel timeout (about 100 s).
const DefaultTimeout = 100 * time.Second

// opTimeout is the bound of every wait on a peer, host or kernel: PYEP_TIMEOUT_S seconds (read
// at start-up), DefaultTimeout by default, or what SetOpTimeout set.
var opTimeout atomic.Int64

func init() {
	d := DefaultTimeout
	if s, err := strconv.ParseFloat(os.Getenv("PYEP_TIMEOUT_S"), 64); err == nil && s > 0 {
		d = time.Duration(s * float64(time.Second))
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
