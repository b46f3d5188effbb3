//go:build unix

package cuda

import (
	"errors"
	"strconv"
	"syscall"
)

// exited reports whether the process a token names (its pid on this host) is gone. A name that
// is no pid (tests' fake processes) is never gone. Tokens of other hosts never get here: such
// peers are refused by CheckPeers.
func exited(process string) bool {
	pid, err := strconv.Atoi(process)
	if err != nil || pid <= 0 {
		return false
	}
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}
