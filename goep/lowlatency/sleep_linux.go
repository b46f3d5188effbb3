//go:build linux

package lowlatency

import (
	"syscall"
	"time"
)

// sleepFor blocks the thread with nanosleep: time.Sleep rounds short sleeps up to about a
// millisecond, which would add that much to a flag's round trip between rank processes.
func sleepFor(d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	_ = syscall.Nanosleep(&ts, nil)
}
