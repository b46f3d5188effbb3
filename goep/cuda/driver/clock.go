package driver

import _ "unsafe" // go:linkname

// MonotonicNS reads CLOCK_MONOTONIC, in nanoseconds: the clock of Python's time.perf_counter. It is
// the Go runtime's clock (the vDSO's clock_gettime on Linux), read without a cgo call, so that
// stamping a launch or an export's entry costs tens of nanoseconds.
func MonotonicNS() int64 { return nanotime() }

//go:linkname nanotime runtime.nanotime
func nanotime() int64
