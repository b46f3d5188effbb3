//go:build unix

package cuda

import (
	"bytes"
	"errors"
	"os"
	"strconv"
	"syscall"
)

// exited reports whether the process a token names (its pid on this host) is gone: no such
// process, or a zombie that its parent has not reaped yet (its memory is released already). A
// name that is no pid (tests' fake processes) is never gone. Tokens of other hosts never get
// here: such peers are refused by CheckPeers.
func exited(process string) bool {
	pid, err := strconv.Atoi(process)
	if err != nil || pid <= 0 {
		return false
	}
	if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
		return true
	}
	// /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')'.
	stat, err := os.ReadFile("/proc/" + process + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}
