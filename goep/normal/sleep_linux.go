//go:build linux

package normal

import (
	"syscall"
	"time"
)

// sleepFor pauses the calling goroutine's thread. Go's time.Sleep rounds
// short sleeps up to about a millisecond on an idle Linux process (the
// netpoller's timeout granularity); nanosleep wakes within ~50µs, which is
// what keeps ring hand-offs between rank processes fast while still giving
// the CPU away. Blocking the thread is fine: the runtime hands the P over.
func sleepFor(d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	_ = syscall.Nanosleep(&ts, nil)
}
