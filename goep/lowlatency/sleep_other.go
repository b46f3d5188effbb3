//go:build !linux

package lowlatency

import "time"

func sleepFor(d time.Duration) { time.Sleep(d) }
