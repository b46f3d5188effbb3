//go:build unix

package cuda

import (
	"os"
	"os/exec"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestExited(t *testing.T) {
	assert.False(t, exited(strconv.Itoa(os.Getpid())), "this process lives")
	assert.False(t, exited("rank1"), "a fake process name is never gone")
	cmd := exec.Command("true")
	require.NoError(t, cmd.Run())
	assert.True(t, exited(strconv.Itoa(cmd.Process.Pid)), "a reaped child is gone")
}
