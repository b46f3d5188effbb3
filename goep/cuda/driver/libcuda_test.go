//go:build cgo

package driver

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/jit"
)

func TestLoadError(t *testing.T) {
	err := load("libpyep-no-such-driver.so.1")
	require.Error(t, err)
	assert.Regexp(t, `^pyep: cannot load the CUDA driver \(libpyep-no-such-driver\.so\.1\): .*libpyep-no-such-driver\.so\.1.*; the cpu backend needs none$`, err.Error())
	if _, err := Open(); err != nil {
		assert.Regexp(t, `^pyep: (cannot load the CUDA driver \(libcuda\.so\.1\): .+; the cpu backend needs none|the CUDA driver \(libcuda\.so\.1\) loaded, but cuInit failed: .+)$`, err.Error())
	}
}

// openGPU skips without a usable driver and GPU; otherwise it returns device 0 with its primary
// context current on this test's (locked) thread.
func openGPU(t *testing.T) (Driver, Device, Context) {
	t.Helper()
	return openGPUOrdinal(t, 0)
}

func openGPUOrdinal(t *testing.T, ordinal int) (Driver, Device, Context) {
	t.Helper()
	drv, err := Open()
	if err != nil {
		t.Skipf("no CUDA driver, so no driver-level test: %v", err)
	}
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	if n == 0 {
		t.Skip("the CUDA driver sees no GPU")
	}
	if ordinal >= n {
		t.Skipf("device %d wanted, %d present", ordinal, n)
	}
	dev, err := drv.DeviceGet(ordinal)
	require.NoError(t, err)
	ctx, err := dev.PrimaryContext()
	require.NoError(t, err)
	runtime.LockOSThread()
	t.Cleanup(func() {
		assert.NoError(t, ctx.Release())
		runtime.UnlockOSThread()
	})
	require.NoError(t, ctx.MakeCurrent())
	return drv, dev, ctx
}

// compile builds a kernel for dev, skipping where NVRTC is missing.
func compile(t *testing.T, dev Device, src jit.Source, opts jit.Options) []byte {
	t.Helper()
	if _, err := jit.LoadNVRTC(); err != nil {
		t.Skipf("NVRTC not found, so no kernel to run: %v", err)
	}
	arch, err := dev.Arch()
	require.NoError(t, err)
	opts.Arch = arch
	out, err := jit.NewCache("").Compile(src, opts)
	require.NoError(t, err)
	return out
}

func TestGPUResultNames(t *testing.T) {
	openGPU(t)
	for r := range knownResults {
		name, desc, ok := driverErrorText(r)
		require.True(t, ok)
		wantName, wantDesc := r.builtinText()
		assert.Equal(t, wantName, name)
		assert.Equal(t, wantDesc, desc, "%s", name)
	}
}

func TestGPUDevice(t *testing.T) {
	drv, dev, ctx := openGPU(t)
	version, err := drv.DriverVersion()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, version, 12000)

	name, err := dev.Name()
	require.NoError(t, err)
	bus, err := dev.PCIBusID()
	require.NoError(t, err)
	assert.Regexp(t, `^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9]$`, bus)
	sms, err := dev.Attribute(AttrMultiprocessorCount)
	require.NoError(t, err)
	assert.Positive(t, sms)
	arch, err := dev.Arch()
	require.NoError(t, err)
	assert.Regexp(t, `^sm_\d+$`, arch)
	total, err := dev.TotalMem()
	require.NoError(t, err)
	free, total2, err := drv.MemGetInfo()
	require.NoError(t, err)
	assert.Equal(t, total, total2)
	assert.LessOrEqual(t, free, total)
	least, greatest, err := drv.CtxGetStreamPriorityRange()
	require.NoError(t, err)
	assert.LessOrEqual(t, greatest, least)
	t.Logf("driver %d, %s (%s, %d SMs, %d GiB) at %s, stream priorities %d..%d", version, name, arch, sms, total>>30, bus, least, greatest)

	cur, err := drv.CtxGetCurrent()
	require.NoError(t, err)
	assert.Equal(t, ctx.Raw(), cur.Raw())
	assert.Equal(t, dev.Ordinal(), cur.Device().Ordinal())

	if n, _ := drv.DeviceCount(); n > 1 {
		peer, err := drv.DeviceGet(1)
		require.NoError(t, err)
		ok, err := dev.CanAccessPeer(peer)
		require.NoError(t, err)
		t.Logf("device 0 can access device 1: %v", ok)
	}

	_, err = drv.DeviceGet(1 << 20)
	assert.ErrorIs(t, err, ErrorInvalidDevice)
}

func TestGPUMemoryStreamsEvents(t *testing.T) {
	drv, _, _ := openGPU(t)
	const n = 1 << 20
	p, err := drv.MemAlloc(n)
	require.NoError(t, err)
	defer func() { assert.NoError(t, drv.MemFree(p)) }()
	q, err := drv.MemAlloc(n)
	require.NoError(t, err)
	defer func() { assert.NoError(t, drv.MemFree(q)) }()

	kind, err := drv.PointerGetAttribute(PointerAttrMemoryType, p.Add(100))
	require.NoError(t, err)
	assert.EqualValues(t, MemoryTypeDevice, kind)
	size, err := drv.PointerGetAttribute(PointerAttrRangeSize, p.Add(100))
	require.NoError(t, err)
	assert.EqualValues(t, n, size)

	require.NoError(t, drv.MemsetD8(p, 0x11, n))
	pattern := make([]byte, 4096)
	for i := range pattern {
		pattern[i] = byte(i * 7)
	}
	require.NoError(t, drv.MemcpyHtoD(p.Add(8192), pattern))

	s, err := drv.StreamCreate(StreamNonBlocking, 0)
	require.NoError(t, err)
	defer func() { assert.NoError(t, s.Destroy()) }()
	start, err := drv.EventCreate(EventDefault)
	require.NoError(t, err)
	end, err := drv.EventCreate(EventDefault)
	require.NoError(t, err)
	order, err := drv.EventCreate(EventDisableTiming)
	require.NoError(t, err)
	for _, e := range []Event{start, end, order} {
		defer func() { assert.NoError(t, e.Destroy()) }()
	}

	require.NoError(t, start.Record(s))
	require.NoError(t, drv.MemsetD8Async(q, 0x22, n, s))
	require.NoError(t, drv.MemcpyAsync(q.Add(4096), p.Add(8192), len(pattern), s))
	require.NoError(t, end.Record(s))
	require.NoError(t, order.Record(s))

	// Host-mapped memory, as kernels use for counters the CPU polls: the copy reaches it
	// through its device address and shows at its host address.
	h, err := drv.MemHostAlloc(4096, HostAllocDeviceMap|HostAllocPortable)
	require.NoError(t, err)
	defer func() { assert.NoError(t, drv.MemFreeHost(h)) }()
	hp, err := drv.MemHostGetDevicePointer(h)
	require.NoError(t, err)
	other, err := drv.StreamCreate(StreamNonBlocking, 0)
	require.NoError(t, err)
	defer func() { assert.NoError(t, other.Destroy()) }()
	require.NoError(t, other.WaitEvent(order))
	require.NoError(t, drv.MemcpyAsync(hp, q.Add(4096), len(pattern), other))
	require.NoError(t, other.Synchronize())
	assert.Equal(t, pattern, unsafe.Slice((*byte)(h), len(pattern)), "ordered after s's copy by the event")

	require.NoError(t, end.Synchronize())
	done, err := end.Query()
	require.NoError(t, err)
	assert.True(t, done)
	idle, err := s.Query()
	require.NoError(t, err)
	assert.True(t, idle)
	elapsed, err := start.Elapsed(end)
	require.NoError(t, err)
	assert.Greater(t, elapsed, time.Duration(0))
	_, err = start.Elapsed(order)
	assert.Error(t, err, "order was created without timing")
	t.Logf("1 MiB memset + 4 KiB copy: %v of GPU time", elapsed)

	back := make([]byte, 3*4096)
	require.NoError(t, drv.MemcpyDtoH(back, q))
	assert.Equal(t, bytesOf(0x22, 4096), back[:4096])
	assert.Equal(t, pattern, back[4096:8192])
	assert.Equal(t, bytesOf(0x22, 4096), back[8192:])

	_, err = drv.MemAlloc(-1)
	assert.ErrorIs(t, err, ErrorInvalidValue)
}

func bytesOf(b byte, n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = b
	}
	return out
}

// selftestParams holds pyep_selftest's parameters in declaration order; Launch gets pointers
// to the fields.
type selftestParams struct {
	a, b, sum, x, xFP8, xBack, y, yBack, warpCounts, flags, errRec DevicePtr
	rank                                                           int32
	timeoutNS                                                      uint64
	n                                                              int32
}

func (p *selftestParams) args() []unsafe.Pointer {
	return []unsafe.Pointer{
		unsafe.Pointer(&p.a), unsafe.Pointer(&p.b), unsafe.Pointer(&p.sum), unsafe.Pointer(&p.x),
		unsafe.Pointer(&p.xFP8), unsafe.Pointer(&p.xBack), unsafe.Pointer(&p.y), unsafe.Pointer(&p.yBack),
		unsafe.Pointer(&p.warpCounts), unsafe.Pointer(&p.flags), unsafe.Pointer(&p.errRec),
		unsafe.Pointer(&p.rank), unsafe.Pointer(&p.timeoutNS), unsafe.Pointer(&p.n),
	}
}

// Host references, rounding to nearest even like the GPU's cvt.rn.
func toBF16(f float32) uint16 {
	b := math.Float32bits(f)
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

func fromBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// roundTo rounds x to a binary format with mbits mantissa bits and minimum normal exponent
// emin, saturating at maxAbs (e4m3's satfinite) or overflowing to infinity (fp16).
func roundTo(x float64, mbits, emin int, maxAbs float64, saturate bool) float64 {
	if x == 0 {
		return x
	}
	e := max(math.Ilogb(math.Abs(x)), emin)
	ulp := math.Ldexp(1, e-mbits)
	r := math.RoundToEven(x/ulp) * ulp
	if math.Abs(r) > maxAbs {
		if saturate {
			return math.Copysign(maxAbs, x)
		}
		return math.Inf(int(math.Copysign(1, x)))
	}
	return r
}

func TestGPUSelftestKernel(t *testing.T) {
	drv, dev, _ := openGPU(t)
	src, err := jit.Kernel("selftest.cu")
	require.NoError(t, err)
	const scale = 3
	cubin := compile(t, dev, src, jit.Options{Defines: map[string]string{"PYEP_SELFTEST_SCALE": "3"}})
	mod, err := drv.ModuleLoadData(cubin)
	require.NoError(t, err)
	defer func() { assert.NoError(t, mod.Unload()) }()
	fn, err := mod.Function("pyep_selftest")
	require.NoError(t, err)
	regs, err := fn.Attribute(FuncAttrNumRegs)
	require.NoError(t, err)
	t.Logf("pyep_selftest: %d registers", regs)

	const n, block = 1000, 256
	const grid = (n + block - 1) / block
	const warps = grid * block / 32
	a, b := make([]byte, 2*n), make([]byte, 2*n)
	x, y := make([]byte, 4*n), make([]byte, 4*n)
	xs := make([]float32, n)
	ys := make([]float32, n)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint16(a[2*i:], toBF16(float32(i)*0.37-100))
		binary.LittleEndian.PutUint16(b[2*i:], toBF16(float32(i%13)*1.1+0.001))
		// Spread over e4m3's range and beyond it (to saturation), both signs.
		xs[i] = float32(math.Copysign(math.Pow(2, float64(i%64)/3-12)*(1+float64(i%7)/9), float64(i%2*2-1)))
		ys[i] = float32(i)*0.123 - 50 + float32(i%5)*1e-4
		binary.LittleEndian.PutUint32(x[4*i:], math.Float32bits(xs[i]))
		binary.LittleEndian.PutUint32(y[4*i:], math.Float32bits(ys[i]))
	}

	// One device allocation carved into the arrays; the flags and the error record in
	// host-mapped memory, where the CPU can watch them.
	offsets := map[string]int{}
	total := 0
	for _, r := range []struct {
		name string
		size int
	}{{"a", 2 * n}, {"b", 2 * n}, {"sum", 2 * n}, {"x", 4 * n}, {"xFP8", n}, {"xBack", 4 * n}, {"y", 4 * n}, {"yBack", 4 * n}, {"warps", 4 * warps}} {
		offsets[r.name] = total
		total += (r.size + 255) / 256 * 256
	}
	mem, err := drv.MemAlloc(total)
	require.NoError(t, err)
	defer func() { assert.NoError(t, drv.MemFree(mem)) }()
	require.NoError(t, drv.MemsetD8(mem, 0, total))
	host, err := drv.MemHostAlloc(64, HostAllocDeviceMap)
	require.NoError(t, err)
	defer func() { assert.NoError(t, drv.MemFreeHost(host)) }()
	hostBytes := unsafe.Slice((*byte)(host), 64)
	clear(hostBytes)
	hostDev, err := drv.MemHostGetDevicePointer(host)
	require.NoError(t, err)
	at := func(name string) DevicePtr { return mem.Add(offsets[name]) }
	require.NoError(t, drv.MemcpyHtoD(at("a"), a))
	require.NoError(t, drv.MemcpyHtoD(at("b"), b))
	require.NoError(t, drv.MemcpyHtoD(at("x"), x))
	require.NoError(t, drv.MemcpyHtoD(at("y"), y))
	binary.LittleEndian.PutUint32(hostBytes[32:], 1) // flags[0]: the wait that must succeed

	params := &selftestParams{
		a: at("a"), b: at("b"), sum: at("sum"), x: at("x"), xFP8: at("xFP8"), xBack: at("xBack"),
		y: at("y"), yBack: at("yBack"), warpCounts: at("warps"), flags: hostDev.Add(32), errRec: hostDev,
		rank: 5, timeoutNS: uint64(time.Millisecond), n: n,
	}
	s, err := drv.StreamCreate(StreamNonBlocking, 0)
	require.NoError(t, err)
	defer func() { assert.NoError(t, s.Destroy()) }()
	require.NoError(t, fn.Launch([3]uint32{grid, 1, 1}, [3]uint32{block, 1, 1}, 0, s, params.args()...))
	require.NoError(t, s.Synchronize())

	sum := make([]byte, 2*n)
	fp8 := make([]byte, n)
	xBack, yBack := make([]byte, 4*n), make([]byte, 4*n)
	counts := make([]byte, 4*warps)
	require.NoError(t, drv.MemcpyDtoH(sum, at("sum")))
	require.NoError(t, drv.MemcpyDtoH(fp8, at("xFP8")))
	require.NoError(t, drv.MemcpyDtoH(xBack, at("xBack")))
	require.NoError(t, drv.MemcpyDtoH(yBack, at("yBack")))
	require.NoError(t, drv.MemcpyDtoH(counts, at("warps")))

	bad := 0
	for i := 0; i < n && bad < 10; i++ {
		av := fromBF16(binary.LittleEndian.Uint16(a[2*i:]))
		bv := fromBF16(binary.LittleEndian.Uint16(b[2*i:]))
		want := toBF16((av + bv) * scale)
		got := binary.LittleEndian.Uint16(sum[2*i:])
		wantX := float32(roundTo(float64(xs[i]), 3, -6, 448, true))
		gotX := math.Float32frombits(binary.LittleEndian.Uint32(xBack[4*i:]))
		wantY := float32(roundTo(float64(ys[i]), 10, -14, 65504, false))
		gotY := math.Float32frombits(binary.LittleEndian.Uint32(yBack[4*i:]))
		if !assert.Equal(t, want, got, "bf16 sum %d", i) || !assert.Equal(t, wantX, gotX, "e4m3 round trip of %g (%d)", xs[i], i) ||
			!assert.Equal(t, wantY, gotY, "fp16 round trip of %g (%d)", ys[i], i) {
			bad++
		}
	}
	assert.Equal(t, byte(0x7e), fp8[slicesIndex(xs, func(v float32) bool { return v > 448 })], "saturates to the largest finite e4m3 (0x7e = 448)")
	for w := 0; w < warps; w++ {
		want := min(32, max(0, n-32*w))
		assert.EqualValues(t, want, binary.LittleEndian.Uint32(counts[4*w:]), "warp %d", w)
	}

	// The bounded wait: flags[0] was set, flags[1] never is, so the second wait gives up after
	// about 1 ms and fills the record; flags[2] is the release store after it.
	assert.EqualValues(t, 1, binary.LittleEndian.Uint32(hostBytes[40:]), "flags[2]")
	require.Equal(t, 32, int(unsafe.Sizeof(errorRecord{})))
	rec := *(*errorRecord)(host)
	assert.EqualValues(t, 1, rec.claimed)
	assert.EqualValues(t, 1, rec.code, "kErrorTimeout")
	assert.EqualValues(t, 5, rec.rank)
	assert.EqualValues(t, 7, rec.channel)
	assert.EqualValues(t, 42, rec.what)
	assert.EqualValues(t, 0, rec.block)
	assert.GreaterOrEqual(t, rec.waitedNS, uint64(time.Millisecond))
	assert.Less(t, rec.waitedNS, uint64(time.Second))
	t.Logf("timed-out wait recorded after %v", time.Duration(rec.waitedNS))

	// PTX loads too (the driver JIT-compiles it), through the NUL-terminating path.
	ptx := compile(t, dev, src, jit.Options{PTX: true})
	require.NotEqual(t, byte(0), ptx[len(ptx)-1])
	pmod, err := drv.ModuleLoadData(ptx)
	require.NoError(t, err)
	_, err = pmod.Function("pyep_selftest")
	assert.NoError(t, err)
	assert.NoError(t, pmod.Unload())
	_, err = mod.Function("no_such_kernel")
	assert.ErrorIs(t, err, ErrorNotFound)
}

// errorRecord mirrors utils.cuh's ErrorRecord.
type errorRecord struct {
	claimed, code uint32
	rank, channel int32
	what          int32
	block         uint32
	waitedNS      uint64
}

func slicesIndex(s []float32, f func(float32) bool) int {
	for i, v := range s {
		if f(v) {
			return i
		}
	}
	panic("no such element")
}

// TestGPULaunchOverhead checks that a launch allocates nothing when its parameters live in a
// reused struct, and reports what a launch and MakeCurrent cost.
func TestGPULaunchOverhead(t *testing.T) {
	drv, dev, ctx := openGPU(t)
	src := jit.Source{Name: "goep/cuda/nop.cu", Text: `extern "C" __global__ void pyep_nop(unsigned long long p, int n) { if (n < 0) *(int*)p = n; }`}
	mod, err := drv.ModuleLoadData(compile(t, dev, src, jit.Options{}))
	require.NoError(t, err)
	defer func() { assert.NoError(t, mod.Unload()) }()
	fn, err := mod.Function("pyep_nop")
	require.NoError(t, err)
	s, err := drv.StreamCreate(StreamNonBlocking, 0)
	require.NoError(t, err)
	defer func() { assert.NoError(t, s.Destroy()) }()

	params := &struct {
		p DevicePtr
		n int32
	}{0, 1}
	args := []unsafe.Pointer{unsafe.Pointer(&params.p), unsafe.Pointer(&params.n)}
	grid, block := [3]uint32{1, 1, 1}, [3]uint32{32, 1, 1}
	allocs := testing.AllocsPerRun(200, func() {
		params.n++
		if err := fn.Launch(grid, block, 0, s, args...); err != nil {
			panic(err)
		}
	})
	assert.Zero(t, allocs, "allocations per launch")
	require.NoError(t, s.Synchronize())

	const launches = 20000
	start := time.Now()
	for i := 0; i < launches; i++ {
		require.NoError(t, fn.Launch(grid, block, 0, s, args...))
	}
	perLaunch := time.Since(start) / launches
	require.NoError(t, s.Synchronize())

	const calls = 100000
	start = time.Now()
	for i := 0; i < calls; i++ {
		if err := ctx.MakeCurrent(); err != nil {
			require.NoError(t, err)
		}
	}
	perMakeCurrent := time.Since(start) / calls
	t.Logf("launch: %v per call (host side, %v allocations); MakeCurrent: %v per call", perLaunch, allocs, perMakeCurrent)
}

// TestGPUIPC exports device memory to a child process (this test binary again, running
// TestGPUIPCChild), which reads what the parent wrote and writes back: on the same GPU, and on
// a second GPU where there is one, which is how ranks share their NVLink buffers.
func TestGPUIPC(t *testing.T) {
	drv, _, ctx := openGPU(t)
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	for child := 0; child < min(n, 2); child++ {
		t.Run(fmt.Sprintf("child on device %d", child), func(t *testing.T) {
			// A subtest is another goroutine, maybe on another thread: the context is per
			// thread, so this is an entry like any other.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			require.NoError(t, ctx.MakeCurrent())
			const size = 1 << 16
			p, err := drv.MemAlloc(size)
			require.NoError(t, err)
			defer func() { assert.NoError(t, drv.MemFree(p)) }()
			require.NoError(t, drv.MemsetD8(p, 0xa5, size/2))
			require.NoError(t, drv.MemsetD8(p.Add(size/2), 0, size/2))
			h, err := drv.IpcGetMemHandle(p)
			require.NoError(t, err)
			assert.NotEqual(t, IpcMemHandle{}, h)

			_, err = drv.IpcOpenMemHandle(h)
			require.ErrorIs(t, err, ErrorInvalidContext, "a process cannot open its own handle (the fake mimics this)")

			cmd := exec.Command(os.Args[0], "-test.run=^TestGPUIPCChild$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), "PYEP_TEST_IPC_HANDLE="+hex.EncodeToString(h[:]), fmt.Sprintf("PYEP_TEST_IPC_DEVICE=%d", child))
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			require.Contains(t, string(out), "--- PASS: TestGPUIPCChild", "%s", out)

			back := make([]byte, size)
			require.NoError(t, drv.MemcpyDtoH(back, p))
			assert.Equal(t, bytesOf(0xa5, size/2), back[:size/2])
			assert.Equal(t, bytesOf(0x5a, size/2), back[size/2:], "the child's writes")
		})
	}
}

func TestGPUIPCChild(t *testing.T) {
	hs := os.Getenv("PYEP_TEST_IPC_HANDLE")
	if hs == "" {
		t.Skip("run by TestGPUIPC in a child process")
	}
	ordinal, err := strconv.Atoi(os.Getenv("PYEP_TEST_IPC_DEVICE"))
	require.NoError(t, err)
	drv, _, _ := openGPUOrdinal(t, ordinal)
	raw, err := hex.DecodeString(hs)
	require.NoError(t, err)
	var h IpcMemHandle
	require.Len(t, raw, len(h))
	copy(h[:], raw)
	p, err := drv.IpcOpenMemHandle(h)
	require.NoError(t, err)
	const size = 1 << 16
	got := make([]byte, size/2)
	require.NoError(t, drv.MemcpyDtoH(got, p))
	assert.Equal(t, bytesOf(0xa5, size/2), got)
	// A copy engine write through the mapping, as a kernel's stores over NVLink would be.
	require.NoError(t, drv.MemsetD8(p.Add(size/2), 0x5a, size/2))
	require.NoError(t, drv.CtxSynchronize())
	require.NoError(t, drv.IpcCloseMemHandle(p))
}
