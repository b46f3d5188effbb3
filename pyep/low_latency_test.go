package pyep

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// The low-latency exports stamp their entry as the normal-mode ones do (bench/hostpath.py --ll
// splits a call's host time there), before anything can fail.
func TestLowLatencyExportsStampTheirEntry(t *testing.T) {
	for name, call := range map[string]func() error{
		"LowLatencyDispatch": func() error {
			_, err := LowLatencyDispatch(-5, 128, 7168, 288, 128, 8, true, false, false, false, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
			return err
		},
		"LowLatencyCombine": func() error {
			_, err := LowLatencyCombine(-5, 128, 7168, 288, 128, 8, false, false, false, 0, 0, 0, 0, 0, 0, 0, 0)
			return err
		},
		"LowLatencyReceive": func() error { return LowLatencyReceive(-5, 1, 0) },
	} {
		before := driver.MonotonicNS()
		require.Error(t, call(), name)
		require.GreaterOrEqual(t, LastEntryNs(), before, name)
	}
}
