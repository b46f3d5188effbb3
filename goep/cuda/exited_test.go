//go:build unix

package cuda

import (
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestExited(t *testing.T) {
	assert.False(t, exited(strconv.Itoa(os.Getpid())), "this process lives")
	assert.False(t, exited("rank1"), "a fake process name is never gone")
	cmd := exec.Command("true")
	require.NoError(t, cmd.Start())
	require.Eventually(t, func() bool { return exited(strconv.Itoa(cmd.Process.Pid)) }, 10*time.Second, time.Millisecond,
		"a child that has exited but is not reaped yet (a zombie) is gone")
	require.NoError(t, cmd.Wait())
	assert.True(t, exited(strconv.Itoa(cmd.Process.Pid)), "a reaped child is gone")
}
