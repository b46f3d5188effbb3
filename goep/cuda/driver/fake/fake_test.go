package fake_test

import (
	"encoding/binary"
	"errors"
	"math"
	"runtime/debug"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
)

// process is one fake rank with its device's primary context current.
func process(t *testing.T, w *fake.World, ordinal int) (*fake.Driver, driver.Context) {
	t.Helper()
	d := fake.New(fake.Config{World: w, Devices: 8})
	dev, err := d.DeviceGet(ordinal)
	require.NoError(t, err)
	ctx, err := dev.PrimaryContext()
	require.NoError(t, err)
	require.NoError(t, ctx.MakeCurrent())
	return d, ctx
}

func TestDevices(t *testing.T) {
	d := fake.New(fake.Config{Devices: 2, SMs: 78, Major: 9, Minor: 0})
	n, err := d.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, 2, n)

	dev, err := d.DeviceGet(1)
	require.NoError(t, err)
	tests := []struct {
		attr driver.DeviceAttribute
		want int
	}{
		{driver.AttrMultiprocessorCount, 78},
		{driver.AttrComputeCapabilityMajor, 9},
		{driver.AttrComputeCapabilityMinor, 0},
		{driver.AttrMaxThreadsPerBlock, 1024},
	}
	for _, tt := range tests {
		got, err := dev.Attribute(tt.attr)
		require.NoError(t, err)
		assert.Equal(t, tt.want, got, "attribute %d", tt.attr)
	}
	arch, err := dev.Arch()
	require.NoError(t, err)
	assert.Equal(t, "sm_90", arch)
	bus, err := dev.PCIBusID()
	require.NoError(t, err)
	assert.Equal(t, "0000:28:00.0", bus)

	other, err := d.DeviceGet(0)
	require.NoError(t, err)
	ok, err := dev.CanAccessPeer(other)
	require.NoError(t, err)
	assert.True(t, ok)

	_, err = d.DeviceGet(2)
	assert.ErrorIs(t, err, driver.ErrorInvalidDevice)
}

func TestNeedsCurrentContext(t *testing.T) {
	d := fake.New(fake.Config{})
	_, err := d.MemAlloc(16)
	assert.ErrorIs(t, err, driver.ErrorInvalidContext)

	dev, err := d.DeviceGet(0)
	require.NoError(t, err)
	ctx, err := dev.PrimaryContext()
	require.NoError(t, err)
	require.NoError(t, ctx.MakeCurrent())
	cur, err := d.CtxGetCurrent()
	require.NoError(t, err)
	assert.Equal(t, ctx, cur)
	p, err := d.MemAlloc(16)
	require.NoError(t, err)
	require.NoError(t, d.MemFree(p))

	require.NoError(t, ctx.Release())
	assert.ErrorIs(t, ctx.Release(), driver.ErrorInvalidContext, "released more often than retained")
}

func TestMemory(t *testing.T) {
	d, _ := process(t, nil, 0)
	p, err := d.MemAlloc(1000)
	require.NoError(t, err)
	assert.Zero(t, uint64(p)%256, "aligned like cudaMalloc")

	require.NoError(t, d.MemsetD8(p, 0xab, 1000))
	require.NoError(t, d.MemcpyHtoD(p.Add(10), []byte{1, 2, 3}))
	out := make([]byte, 6)
	require.NoError(t, d.MemcpyDtoH(out, p.Add(8)))
	assert.Equal(t, []byte{0xab, 0xab, 1, 2, 3, 0xab}, out)

	q, err := d.MemAlloc(1000)
	require.NoError(t, err)
	s, err := d.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(t, err)
	require.NoError(t, d.MemsetD8Async(q, 7, 1000, s))
	require.NoError(t, d.MemcpyAsync(q.Add(500), p.Add(10), 3, s))
	b, err := d.Bytes(q.Add(499), 5)
	require.NoError(t, err)
	assert.Equal(t, []byte{7, 1, 2, 3, 7}, b)

	_, err = d.Bytes(p.Add(999), 2)
	assert.ErrorIs(t, err, driver.ErrorIllegalAddress, "overrun")
	assert.ErrorIs(t, d.MemcpyHtoD(p.Add(5000), []byte{1}), driver.ErrorIllegalAddress)

	size, err := d.PointerGetAttribute(driver.PointerAttrRangeSize, p.Add(17))
	require.NoError(t, err)
	assert.EqualValues(t, 1000, size)
	start, err := d.PointerGetAttribute(driver.PointerAttrRangeStartAddr, p.Add(17))
	require.NoError(t, err)
	assert.EqualValues(t, p, start)

	free, total, err := d.MemGetInfo()
	require.NoError(t, err)
	assert.Equal(t, total-2000, free)
	_, err = d.MemAlloc(total)
	assert.ErrorIs(t, err, driver.ErrorOutOfMemory)
	_, err = d.MemAlloc(0)
	assert.ErrorIs(t, err, driver.ErrorInvalidValue)

	assert.ErrorIs(t, d.MemFree(p.Add(1)), driver.ErrorInvalidValue, "not the start of an allocation")
	require.NoError(t, d.MemFree(p))
	require.NoError(t, d.MemFree(q))
	require.NoError(t, s.Destroy())
	assert.Zero(t, d.Live())
}

func TestHostMappedMemory(t *testing.T) {
	d, _ := process(t, nil, 0)
	h, err := d.MemHostAlloc(64, driver.HostAllocDeviceMap|driver.HostAllocPortable)
	require.NoError(t, err)
	dp, err := d.MemHostGetDevicePointer(h)
	require.NoError(t, err)
	require.NoError(t, d.MemsetD8(dp.Add(4), 9, 2))
	host := unsafe.Slice((*byte)(h), 64)
	assert.Equal(t, []byte{0, 9, 9, 0}, host[3:7], "the device's writes show on the host")
	kind, err := d.PointerGetAttribute(driver.PointerAttrMemoryType, dp)
	require.NoError(t, err)
	assert.EqualValues(t, driver.MemoryTypeHost, kind)
	require.NoError(t, d.MemFreeHost(h))
	assert.Zero(t, d.Live())
}

func TestIPC(t *testing.T) {
	w := fake.NewWorld()
	a, _ := process(t, w, 0)
	b, _ := process(t, w, 1)

	p, err := a.MemAlloc(256)
	require.NoError(t, err)
	h, err := a.IpcGetMemHandle(p)
	require.NoError(t, err)
	_, err = a.IpcOpenMemHandle(h)
	assert.ErrorIs(t, err, driver.ErrorInvalidContext, "a process cannot open its own handle")

	peer, err := b.IpcOpenMemHandle(h)
	require.NoError(t, err)
	_, err = b.IpcOpenMemHandle(h)
	assert.ErrorIs(t, err, driver.ErrorInvalidValue, "opened twice")
	require.NoError(t, b.MemsetD8(peer.Add(100), 5, 1))
	got, err := a.Bytes(p.Add(100), 1)
	require.NoError(t, err)
	assert.Equal(t, []byte{5}, got, "both map the same memory")

	// The exporter frees first: the importer's mapping stays valid until it closes it.
	require.NoError(t, a.MemFree(p))
	_, err = b.Bytes(peer, 256)
	assert.NoError(t, err)
	require.NoError(t, b.IpcCloseMemHandle(peer))
	assert.ErrorIs(t, b.IpcCloseMemHandle(peer), driver.ErrorInvalidValue)
	_, err = b.IpcOpenMemHandle(h)
	assert.ErrorIs(t, err, driver.ErrorInvalidValue, "the allocation is gone")

	var garbage driver.IpcMemHandle
	_, err = b.IpcOpenMemHandle(garbage)
	assert.ErrorIs(t, err, driver.ErrorInvalidValue)
	assert.Zero(t, a.Live())
	assert.Zero(t, b.Live())
}

// axpy stands for a real kernel: y[i] = a*x[i] + y[i] over n float32s.
func axpy(l *fake.Launch) error {
	x, y, a, n := l.DevicePtr(0), l.DevicePtr(1), l.Float32(2), int(l.Int32(3))
	xb, err := l.Mem(x, 4*n)
	if err != nil {
		return err
	}
	yb, err := l.Mem(y, 4*n)
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		xi := math.Float32frombits(binary.LittleEndian.Uint32(xb[4*i:]))
		yi := math.Float32frombits(binary.LittleEndian.Uint32(yb[4*i:]))
		binary.LittleEndian.PutUint32(yb[4*i:], math.Float32bits(a*xi+yi))
	}
	return nil
}

func TestLaunch(t *testing.T) {
	w := fake.NewWorld()
	w.RegisterKernel("axpy", axpy)
	d, _ := process(t, w, 0)

	mod, err := d.ModuleLoadData([]byte("\x7fELF..."))
	require.NoError(t, err)
	_, err = mod.Function("missing")
	assert.ErrorIs(t, err, driver.ErrorNotFound)
	fn, err := mod.Function("axpy")
	require.NoError(t, err)
	assert.Equal(t, "axpy", fn.Name())

	const n = 4
	x, err := d.MemAlloc(4 * n)
	require.NoError(t, err)
	y, err := d.MemAlloc(4 * n)
	require.NoError(t, err)
	xs := make([]byte, 4*n)
	ys := make([]byte, 4*n)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint32(xs[4*i:], math.Float32bits(float32(i)))
		binary.LittleEndian.PutUint32(ys[4*i:], math.Float32bits(1))
	}
	require.NoError(t, d.MemcpyHtoD(x, xs))
	require.NoError(t, d.MemcpyHtoD(y, ys))

	// Parameters in one struct, reused across launches, as the backend will keep them.
	params := struct {
		x, y driver.DevicePtr
		a    float32
		n    int32
	}{x, y, 2, n}
	stream := driver.WrapStream(d, 0)
	args := []unsafe.Pointer{unsafe.Pointer(&params.x), unsafe.Pointer(&params.y), unsafe.Pointer(&params.a), unsafe.Pointer(&params.n)}
	require.NoError(t, fn.Launch([3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}, 0, stream, args...))
	require.NoError(t, d.MemcpyDtoH(ys, y))
	for i := 0; i < n; i++ {
		assert.Equal(t, float32(2*i+1), math.Float32frombits(binary.LittleEndian.Uint32(ys[4*i:])))
	}

	bad := []struct {
		name         string
		grid, block  [3]uint32
		shared       uint32
		stream       driver.Stream
		want         error
		setMaxShared int
	}{
		{"empty grid", [3]uint32{0, 1, 1}, [3]uint32{32, 1, 1}, 0, stream, driver.ErrorInvalidValue, 0},
		{"block too large", [3]uint32{1, 1, 1}, [3]uint32{1024, 2, 1}, 0, stream, driver.ErrorInvalidValue, 0},
		{"shared memory above 48 KiB unannounced", [3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}, 64 << 10, stream, driver.ErrorInvalidValue, 0},
		{"shared memory announced", [3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}, 64 << 10, stream, nil, 64 << 10},
		{"unknown stream", [3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}, 0, driver.WrapStream(d, 0xdead), driver.ErrorInvalidHandle, 0},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			if tt.setMaxShared != 0 {
				require.NoError(t, fn.SetAttribute(driver.FuncAttrMaxDynamicSharedSizeBytes, tt.setMaxShared))
			}
			err := fn.Launch(tt.grid, tt.block, tt.shared, tt.stream, args...)
			if tt.want == nil {
				assert.NoError(t, err)
			} else {
				assert.ErrorIs(t, err, tt.want)
			}
		})
	}

	tooMany := make([]unsafe.Pointer, driver.MaxKernelArgs+1)
	assert.ErrorContains(t, fn.Launch([3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, 0, stream, tooMany...), "at most 64")

	failing := errors.New("boom")
	w.RegisterKernel("fails", func(*fake.Launch) error { return failing })
	f2, err := mod.Function("fails")
	require.NoError(t, err)
	assert.ErrorIs(t, f2.Launch([3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, 0, stream), failing)

	assert.Equal(t, 1+len(bad)+1, d.Calls("LaunchKernel"), "every launch but the one Function.Launch refused")
	require.NoError(t, mod.Unload())
	require.NoError(t, d.MemFree(x))
	require.NoError(t, d.MemFree(y))
	assert.Zero(t, d.Live())
}

func TestStreamsAndEvents(t *testing.T) {
	d, _ := process(t, nil, 0)
	least, greatest, err := d.CtxGetStreamPriorityRange()
	require.NoError(t, err)
	s, err := d.StreamCreate(driver.StreamNonBlocking, greatest)
	require.NoError(t, err)
	assert.Less(t, greatest, least+1)

	start, err := d.EventCreate(driver.EventDefault)
	require.NoError(t, err)
	end, err := d.EventCreate(driver.EventDefault)
	require.NoError(t, err)
	untimed, err := d.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)

	_, err = start.Elapsed(end)
	assert.ErrorIs(t, err, driver.ErrorInvalidHandle, "not recorded yet")
	require.NoError(t, start.Record(s))
	time.Sleep(2 * time.Millisecond)
	require.NoError(t, end.Record(s))
	require.NoError(t, untimed.Record(s))
	elapsed, err := start.Elapsed(end)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, elapsed, 2*time.Millisecond)
	_, err = start.Elapsed(untimed)
	assert.ErrorIs(t, err, driver.ErrorInvalidHandle)

	other, err := d.StreamCreate(driver.StreamDefault, 0)
	require.NoError(t, err)
	require.NoError(t, other.WaitEvent(end))
	done, err := end.Query()
	require.NoError(t, err)
	assert.True(t, done)
	idle, err := s.Query()
	require.NoError(t, err)
	assert.True(t, idle)
	require.NoError(t, s.Synchronize())
	require.NoError(t, end.Synchronize())

	for _, e := range []driver.Event{start, end, untimed} {
		require.NoError(t, e.Destroy())
	}
	assert.ErrorIs(t, start.Destroy(), driver.ErrorInvalidHandle)
	require.NoError(t, s.Destroy())
	require.NoError(t, other.Destroy())
	assert.ErrorIs(t, driver.WrapStream(d, 0).Destroy(), driver.ErrorInvalidHandle, "the default stream is not ours to destroy")
	assert.Zero(t, d.Live())
}

func TestFailNext(t *testing.T) {
	d, _ := process(t, nil, 0)
	d.FailNext("MemAlloc", driver.ErrorOutOfMemory)
	_, err := d.MemAlloc(16)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	assert.Contains(t, err.Error(), "CUDA_ERROR_OUT_OF_MEMORY: out of memory")
	p, err := d.MemAlloc(16)
	require.NoError(t, err, "only the next call fails")
	assert.Equal(t, 2, d.Calls("MemAlloc"))
	require.NoError(t, d.MemFree(p))
}

func TestGuardFaultsPastTheEnd(t *testing.T) {
	d := fake.New(fake.Config{Guard: true})
	dev, err := d.DeviceGet(0)
	require.NoError(t, err)
	pc, err := dev.PrimaryContext()
	require.NoError(t, err)
	require.NoError(t, pc.MakeCurrent())
	p, err := d.MemAlloc(1000)
	require.NoError(t, err)
	require.Zero(t, uint64(p)%256)
	b, err := d.Bytes(p, 1000)
	require.NoError(t, err)
	b[999] = 1
	past := unsafe.Slice((*byte)(unsafe.Pointer(&b[0])), 1024+4096)
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	require.Panics(t, func() { past[1024] = 1 })
	require.NoError(t, d.MemFree(p))
	require.Panics(t, func() { b[0] = 1 }, "freed memory faults")
}

// TestTrackOrder: a launch is ordered after the earlier launches of its stream, after those an
// event it waited for stood for when recorded, and after what the host synchronised with.
func TestTrackOrder(t *testing.T) {
	w := fake.NewWorld()
	w.RegisterKernel("k", func(*fake.Launch) error { return nil })
	d, ctx := process(t, w, 0)
	mod, err := d.ModuleLoadData([]byte{1})
	require.NoError(t, err)
	k, err := mod.Function("k")
	require.NoError(t, err)
	a, err := d.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(t, err)
	b, err := d.StreamCreate(driver.StreamNonBlocking, 0)
	require.NoError(t, err)
	ev, err := d.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)
	launch := func(s driver.Stream) {
		require.NoError(t, k.Launch([3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}, 0, s))
	}

	launch(a) // before tracking: not recorded
	assert.Nil(t, d.Launches())
	d.TrackOrder()
	launch(a) // 0
	launch(a) // 1: after 0
	launch(b) // 2: after nothing
	require.NoError(t, ev.Record(a))
	launch(a) // 3: after 0, 1
	require.NoError(t, b.WaitEvent(ev))
	launch(b) // 4: after 2, and 0, 1 through the event; not 3, queued after the record
	require.NoError(t, b.Synchronize())
	launch(a) // 5: a's own (0, 1, 3) and what the host waited for (b's: 0, 1, 2, 4)
	require.NoError(t, ev.Record(b))
	require.NoError(t, ev.Synchronize())
	launch(b) // 6: b's own; 3 and 5 were never waited for
	require.NoError(t, ctx.Synchronize())
	launch(a) // 7: after everything

	l := d.Launches()
	require.Len(t, l, 8)
	after := func(i int) []int {
		var s []int
		for j := range i {
			if l[i].After(j) {
				s = append(s, j)
			}
		}
		return s
	}
	assert.Equal(t, a.Raw(), l[0].Stream)
	assert.Equal(t, b.Raw(), l[2].Stream)
	assert.Equal(t, "k", l[0].Name)
	assert.Nil(t, after(0))
	assert.Equal(t, []int{0}, after(1))
	assert.Nil(t, after(2))
	assert.Equal(t, []int{0, 1}, after(3))
	assert.Equal(t, []int{0, 1, 2}, after(4))
	assert.Equal(t, []int{0, 1, 2, 3, 4}, after(5))
	assert.Equal(t, []int{0, 1, 2, 4}, after(6))
	assert.Equal(t, []int{0, 1, 2, 3, 4, 5, 6}, after(7))
	assert.False(t, l[3].After(3), "not after itself")

	require.NoError(t, ev.Destroy())
	require.NoError(t, a.Destroy())
	require.NoError(t, b.Destroy())
	require.NoError(t, mod.Unload())
	assert.Zero(t, d.Live())
}
