package shm

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCreateOpenUnlink(t *testing.T) {
	s, err := Create(4096)
	require.NoError(t, err)
	defer s.Close()
	s.Data[100] = 42
	peer, err := Open(s.Name, 4096)
	require.NoError(t, err)
	assert.EqualValues(t, 42, peer.Data[100], "both mappings share the memory")
	_, err = Open(s.Name, 8192)
	assert.ErrorContains(t, err, "expected 8192")
	require.NoError(t, s.Unlink())
	require.NoError(t, s.Unlink(), "unlinking twice is fine")
	peer.Data[0] = 1
	assert.EqualValues(t, 1, s.Data[0], "mappings outlive the name")
	require.NoError(t, peer.Close())
	require.NoError(t, peer.Close())
	_, err = Open(s.Name, 4096)
	assert.ErrorIs(t, err, ErrGone)
	_, err = Open("../etc/passwd", 4096)
	assert.ErrorContains(t, err, "not a pyep segment name")
}

func TestSweepRemovesSegmentsOfDeadProcesses(t *testing.T) {
	// A process that has exited: its pid is free (reuse within the test is unlikely).
	cmd := exec.Command("true")
	require.NoError(t, cmd.Run())
	dead := filepath.Join(Dir, fmt.Sprintf("pyep-%d-deadbeef", cmd.Process.Pid))
	require.NoError(t, os.WriteFile(dead, nil, 0o600))
	live, err := Create(4096)
	require.NoError(t, err)
	defer func() { _ = live.Unlink(); _ = live.Close() }()
	removed := Sweep()
	assert.Contains(t, removed, filepath.Base(dead))
	assert.NoFileExists(t, dead)
	assert.FileExists(t, filepath.Join(Dir, live.Name), "a live process's segment stays")
}
