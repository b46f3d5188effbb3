//go:build !linux

package cuda

import (
	"errors"
	"time"
)

// POSIX file descriptors of cuMem memory cross processes over abstract Unix-domain sockets,
// which only Linux has.
var errNoFDSharing = errors.New("sharing file descriptors of device memory needs Linux: use PYEP_MEM_HANDLE=fabric or use_fabric=False")

type fdServer struct{}

func fdSocketName(uint64) string                                   { return "" }
func serveFD(string, int, uint64) (*fdServer, error)               { return nil, errNoFDSharing }
func (s *fdServer) Close() error                                   { return nil }
func receiveFD(string, uint64, string, time.Duration) (int, error) { return -1, errNoFDSharing }
func closeFD(int) error                                            { return nil }
