//go:build !linux

package normal

import "time"

// sleepFor pauses the calling goroutine.
func sleepFor(d time.Duration) { time.Sleep(d) }
