package nvshmem

import (
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/dl/dltest"
)

// TestMain points the search at this machine's Python packages when nobody else has, as the
// Python layer does in real use (PYEP_SITE_PACKAGES).
func TestMain(m *testing.M) {
	dltest.UsePythonSitePackages(DirEnv)
	os.Exit(m.Run())
}

// requireLibrary skips (never fails) where NVSHMEM is absent, saying why and how to get it.
func requireLibrary(t *testing.T) *Library {
	t.Helper()
	l, err := Open()
	var nf *NotFoundError
	if errors.As(err, &nf) || errors.Is(err, errNoCgo) {
		t.Skipf("NVSHMEM not found: %v", err)
	}
	require.NoError(t, err)
	t.Logf("NVSHMEM %s from %s", l.Version, l.Path)
	return l
}

// hasGPU says whether a CUDA device is there (then Init really initialises).
func hasGPU() bool {
	d, err := driver.Open()
	if err != nil {
		return false
	}
	n, err := d.DeviceCount()
	return err == nil && n > 0
}

func TestCandidates(t *testing.T) {
	root := t.TempDir()
	touch := func(rel string) string { return dltest.Touch(t, root, rel) }
	mine := touch("mine/lib/libnvshmem_host.so.3")
	sp1 := touch("sp1/nvidia/nvshmem/lib/libnvshmem_host.so.3")
	sp2 := touch("sp2/nvidia/nvshmem/lib/libnvshmem_host.so.3")
	venv := touch("venv/lib/python3.12/site-packages/nvidia/nvshmem/lib/libnvshmem_host.so.3")
	tests := []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"NVSHMEM_DIR is the only candidate", map[string]string{DirEnv: filepath.Join(root, "mine"), "PYEP_SITE_PACKAGES": filepath.Join(root, "sp1")}, []string{mine}},
		{"NVSHMEM_DIR without the library is named", map[string]string{DirEnv: filepath.Join(root, "none")}, []string{filepath.Join(root, "none/lib/libnvshmem_host.so.3")}},
		{"wheels in site-packages order, then the loader", map[string]string{"PYEP_SITE_PACKAGES": filepath.Join(root, "sp2") + "::" + filepath.Join(root, "sp1")}, []string{sp2, sp1, "libnvshmem_host.so.3"}},
		{"a virtualenv", map[string]string{"VIRTUAL_ENV": filepath.Join(root, "venv")}, []string{venv, "libnvshmem_host.so.3"}},
		{"nothing set: the loader", nil, []string{"libnvshmem_host.so.3"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, Candidates(func(k string) string { return tt.env[k] }))
		})
	}
}

func TestLoadNotFound(t *testing.T) {
	_, err := load([]string{"/nonexistent/lib/libnvshmem_host.so.3", "libc.so.6"})
	if errors.Is(err, errNoCgo) {
		t.Skip("built without cgo: nothing can be loaded at all")
	}
	var nf *NotFoundError
	require.ErrorAs(t, err, &nf)
	require.Len(t, nf.Tried, 2)
	assert.Contains(t, nf.Tried[0], "/nonexistent/lib/libnvshmem_host.so.3 (")
	assert.Contains(t, nf.Tried[1], "lacks nvshmemx_vendor_get_version_info")
	for _, s := range []string{"NVSHMEM_DIR", "PYEP_SITE_PACKAGES", "pip install nvidia-nvshmem-cu12"} {
		assert.Contains(t, err.Error(), s)
	}
}

// The library opens with every entry point of the table, and its installation has what
// kernels are compiled and linked against.
func TestOpen(t *testing.T) {
	l := requireLibrary(t)
	assert.Equal(t, 3, l.Version.Major)
	assert.True(t, filepath.IsAbs(l.Path), l.Path)
	assert.Equal(t, filepath.Dir(l.Path), l.Install.LibDir)
	inc, dev, err := l.Install.DeviceLink()
	if err != nil {
		t.Logf("no device link here: %v", err)
	} else {
		assert.FileExists(t, filepath.Join(inc, "nvshmem.h"))
		assert.FileExists(t, dev)
	}
	again, err := Open()
	require.NoError(t, err)
	assert.Same(t, l, again)
	_, _, err = Install{LibDir: "/x/lib"}.DeviceLink()
	assert.ErrorContains(t, err, "/x/lib")
}

// nvshmemx_get_uniqueid needs no GPU: an id is NVSHMEM's version field and this host's
// bootstrap address, fresh each time.
func TestGetUniqueID(t *testing.T) {
	l := requireLibrary(t)
	a, err := l.GetUniqueID()
	require.NoError(t, err)
	require.NoError(t, a.Check())
	b, err := l.GetUniqueID()
	require.NoError(t, err)
	require.NoError(t, b.Check())
	assert.NotEqual(t, a, b)
}

func TestCheckUniqueID(t *testing.T) {
	var id UniqueID
	assert.ErrorContains(t, id.Check(), "not an NVSHMEM unique id")
	_, err := rand.Read(id[:])
	require.NoError(t, err)
	assert.ErrorContains(t, id.Check(), "version field")
	id = UniqueID{0x80, 0, 1, 0}
	assert.ErrorContains(t, id.Check(), "empty")
	id[9] = 1
	assert.NoError(t, id.Check())
}

// Before Init every call that NVSHMEM would end the process over (or answer with garbage) is
// refused with an error; Init refuses a group that cannot be.
func TestBeforeInit(t *testing.T) {
	l := requireLibrary(t)
	if l.Initialized() {
		t.Skip("NVSHMEM is initialised in this process")
	}
	_, err := l.MyPE()
	assert.ErrorIs(t, err, ErrNotInitialized)
	_, err = l.NPEs()
	assert.ErrorIs(t, err, ErrNotInitialized)
	_, err = l.Malloc(1 << 20)
	assert.ErrorIs(t, err, ErrNotInitialized)
	assert.ErrorIs(t, l.Free(0x1000), ErrNotInitialized)
	assert.ErrorIs(t, l.BarrierAll(), ErrNotInitialized)
	_, err = l.Ptr(0x1000, 0)
	assert.ErrorIs(t, err, ErrNotInitialized)
	assert.ErrorIs(t, l.ModuleInit(0x1000), ErrNotInitialized)
	assert.ErrorIs(t, l.ModuleFinalize(0x1000), ErrNotInitialized)
	assert.ErrorIs(t, l.Finalize(), ErrNotInitialized)
	assert.ErrorContains(t, l.ModuleInit(0), "null module")
	_, err = l.Malloc(0)
	assert.ErrorContains(t, err, "positive size")
	assert.Less(t, l.InitStatus(), 2, "not initialised (1: bootstrapped by a failed init)")

	id, err := l.GetUniqueID()
	require.NoError(t, err)
	for _, g := range []Group{
		{ID: id, Rank: 1, Ranks: 1, Device: -1},
		{ID: id, Rank: -1, Ranks: 2, Device: -1},
		{ID: id, Rank: 0, Ranks: 0, Device: -1},
		{ID: id, Rank: 0, Ranks: 1, Device: -2},
		{ID: UniqueID{}, Rank: 0, Ranks: 1, Device: -1},
	} {
		assert.Error(t, l.Init(g), "%+v", g)
	}
	assert.False(t, l.Initialized())
}

// Without a GPU, init fails with NVSHMEM's status, and the process goes on.
func TestInitWithoutGPU(t *testing.T) {
	l := requireLibrary(t)
	if hasGPU() {
		t.Skip("a GPU is here: TestOnePE initialises for real")
	}
	id, err := l.GetUniqueID()
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- l.Init(Group{ID: id, Rank: 0, Ranks: 1, Device: -1}) }()
	select {
	case err = <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("init of one PE without a GPU did not return in 2 minutes")
	}
	var e *Error
	require.ErrorAs(t, err, &e)
	assert.Equal(t, "nvshmemx_hostlib_init_attr", e.Op)
	t.Log(err)
	assert.False(t, l.Initialized())
	_, err = l.MyPE()
	assert.ErrorIs(t, err, ErrNotInitialized)
}
