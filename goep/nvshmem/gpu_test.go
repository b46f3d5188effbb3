package nvshmem

import (
	"encoding/binary"
	"runtime"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/jit"
)

// TestOnePE runs NVSHMEM end to end on one PE where a GPU is: a unique id, init, the symmetric
// heap, nvshmem_ptr, and goep/jit's probe kernel (linked with libnvshmem_device.a at run time)
// loaded, handed NVSHMEM's device state, launched, putting and signalling to this PE.
func TestOnePE(t *testing.T) {
	if !hasGPU() {
		t.Skip("no GPU: TestInitWithoutGPU covers init here")
	}
	l := requireLibrary(t)
	inc, dev, err := l.Install.DeviceLink()
	require.NoError(t, err)
	// One PE on one GPU: no network transport, a small heap.
	t.Setenv("NVSHMEM_REMOTE_TRANSPORT", "none")
	t.Setenv("NVSHMEM_SYMMETRIC_SIZE", "64M")

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	d, err := driver.Open()
	require.NoError(t, err)
	gpu, err := d.DeviceGet(0)
	require.NoError(t, err)
	ctx, err := d.DevicePrimaryCtxRetain(gpu)
	require.NoError(t, err)
	defer ctx.Release()
	require.NoError(t, ctx.MakeCurrent())
	arch, err := gpu.Arch()
	require.NoError(t, err)

	id, err := l.GetUniqueID()
	require.NoError(t, err)
	require.NoError(t, l.Init(Group{ID: id, Rank: 0, Ranks: 1, Device: 0}))
	defer func() { assert.NoError(t, l.Finalize()) }()
	pe, err := l.MyPE()
	require.NoError(t, err)
	n, err := l.NPEs()
	require.NoError(t, err)
	assert.Equal(t, [2]int{0, 1}, [2]int{pe, n})

	src, err := jit.Kernel("nvshmem_probe.cu")
	require.NoError(t, err)
	probe := map[string]string{"PYEP_NVSHMEM_PROBE": ""}
	cubin, err := jit.NewCache("").CompileLinked(src, jit.LinkOptions{Options: jit.Options{Arch: arch, Defines: probe},
		IncludeDirs: []string{inc}, Libraries: []string{dev}})
	require.NoError(t, err)
	mod, err := d.ModuleLoadData(cubin)
	require.NoError(t, err)
	defer mod.Unload()
	require.NoError(t, l.ModuleInit(mod.Raw()))
	defer func() { assert.NoError(t, l.ModuleFinalize(mod.Raw())) }()
	fn, err := mod.Function("pyep_nvshmem_probe")
	require.NoError(t, err)

	dst, err := l.Malloc(64)
	require.NoError(t, err)
	sig, err := l.Malloc(64)
	require.NoError(t, err)
	assert.Equal(t, 128, l.HeapBytes())
	self, err := l.Ptr(dst, 0)
	require.NoError(t, err)
	assert.Equal(t, dst, self, "nvshmem_ptr of this PE is the address itself")
	out, err := d.MemAlloc(16)
	require.NoError(t, err)
	defer d.MemFree(out)
	require.NoError(t, d.MemcpyHtoD(driver.DevicePtr(dst), make([]byte, 8)))
	require.NoError(t, d.MemcpyHtoD(driver.DevicePtr(sig), make([]byte, 8)))

	args := &struct {
		dst, sig uintptr
		out      driver.DevicePtr
		pe       int32
	}{dst, sig, out, 0}
	require.NoError(t, fn.Launch([3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, 0, driver.Stream{},
		unsafe.Pointer(&args.dst), unsafe.Pointer(&args.sig), unsafe.Pointer(&args.out), unsafe.Pointer(&args.pe)))
	require.NoError(t, ctx.Synchronize())
	require.NoError(t, l.BarrierAll())

	got := make([]byte, 12)
	require.NoError(t, d.MemcpyDtoH(got, out))
	assert.Equal(t, []uint32{1, 0, 1}, []uint32{binary.LittleEndian.Uint32(got), binary.LittleEndian.Uint32(got[4:]), binary.LittleEndian.Uint32(got[8:])},
		"nvshmem_ptr reachable, my_pe, n_pes")
	v := make([]byte, 8)
	require.NoError(t, d.MemcpyDtoH(v[:4], driver.DevicePtr(dst)))
	assert.Equal(t, uint32(1), binary.LittleEndian.Uint32(v), "nvshmem_int_p")
	require.NoError(t, d.MemcpyDtoH(v, driver.DevicePtr(sig)))
	assert.Equal(t, uint64(1), binary.LittleEndian.Uint64(v), "nvshmemx_signal_op")

	require.NoError(t, l.Free(sig))
	require.NoError(t, l.Free(dst))
	assert.Error(t, l.Free(dst), "a second free is refused")
}
