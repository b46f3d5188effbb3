//go:build linux

package driver

import (
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// MonotonicNS is CLOCK_MONOTONIC (Python's time.perf_counter clock): the host path's stamps are compared with
// perf_counter's.
func TestMonotonicNSIsClockMonotonic(t *testing.T) {
	const clockMonotonic = 1
	var ts syscall.Timespec
	before := MonotonicNS()
	_, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockMonotonic, uintptr(unsafe.Pointer(&ts)), 0)
	after := MonotonicNS()
	assert.Zero(t, errno)
	c := ts.Nano()
	assert.LessOrEqual(t, before, c)
	assert.LessOrEqual(t, c, after)
}
