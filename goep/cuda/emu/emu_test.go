//go:build cgo

package emu_test

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
	"github.com/pyep/pyep/goep/cuda/emu"
	cudall "github.com/pyep/pyep/goep/cuda/lowlatency"
	cudanormal "github.com/pyep/pyep/goep/cuda/normal"
	"github.com/pyep/pyep/goep/dlpack"
	"github.com/pyep/pyep/goep/normal"
)

// The GPU engine (goep/cuda/normal) with its kernels emulated on the host, against goep/normal,
// the cpu reference: every output bit for bit.

// engines are the cuda backend's engines, as goep/api composes them.
var engines = goep.Engines{Normal: cudanormal.NewEngine, LowLatency: cudall.NewEngine}

type allLinks struct{}

func (allLinks) NVLinkP2P(a, b string) (bool, string, error) { return true, "OK", nil }

type rankEnv struct {
	r   int
	drv *fake.Driver
	be  *cuda.Backend
	buf *goep.Buffer
}

func newDomain(t *testing.T, R int, nvlBytes int64) []*rankEnv {
	return newDomainWith(t, R, nvlBytes, emu.Options())
}

// emuWaitTimeout bounds the emulated kernels' waits on peers. Each emulated GPU thread is a host
// thread, and the waiting ones spin: under `go test ./...` on two cores, a four-rank case once
// returned combine rows its kernel had not written, with no error at the call, in 32 s instead of
// 12: most likely a wait starved past the 20 s this was, whose timeout only the next call reports.
const emuWaitTimeout = 90 * time.Second

func newDomainWith(t *testing.T, R int, nvlBytes int64, opts cuda.NormalOptions) []*rankEnv {
	return newDomainOf(t, R, nvlBytes, opts, false)
}

// newDomainOf makes R ranks' synced buffers; with useFabric, over fake GPUs with fabric
// handles, and allocated as use_fabric (PYEP_MEM_HANDLE chooses the handle kind).
func newDomainOf(t *testing.T, R int, nvlBytes int64, opts cuda.NormalOptions, useFabric bool) []*rankEnv {
	t.Helper()
	w := fake.NewWorld()
	envs := make([]*rankEnv, R)
	handles := make([][]byte, R)
	for r := range envs {
		d := fake.New(fake.Config{World: w, Devices: 8, MemBytes: 1 << 30, Guard: os.Getenv("PYEP_EMU_NOGUARD") == "", Fabric: useFabric})
		be, err := cuda.NewBackend(d, r, cuda.BackendOptions{Timeout: emuWaitTimeout, NVLink: allLinks{}, Process: fmt.Sprint("rank", r)})
		require.NoError(t, err)
		be.SetNormalOptions(opts)
		buf, err := goep.NewBuffer(goep.Params{Rank: r, NumRanks: R, NumNVLBytes: nvlBytes, UseFabric: useFabric, Engines: engines}, be)
		require.NoError(t, err)
		handles[r], err = buf.LocalIPCHandle()
		require.NoError(t, err)
		envs[r] = &rankEnv{r: r, drv: d, be: be, buf: buf}
	}
	ids := make([]int, R)
	for r := range ids {
		ids[r] = r
	}
	for _, e := range envs {
		require.NoError(t, e.buf.Sync(ids, handles, nil))
	}
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, e := range envs {
			wg.Add(1)
			go func() { defer wg.Done(); assert.NoError(t, e.buf.Destroy()) }()
		}
		wg.Wait()
		for _, e := range envs {
			assert.NoError(t, e.be.Close())
		}
	})
	return envs
}

// normal is the normal-mode engine of the rank's buffer.
func (e *rankEnv) normal() goep.NormalEngine {
	eng, err := e.buf.NormalEngine()
	if err != nil {
		panic(err)
	}
	return eng
}

// dev is a tensor in rank e's fake device memory, with its bytes.
type dev struct {
	t dlpack.Tensor
	b []byte
}

func (e *rankEnv) alloc(t *testing.T, dt dlpack.DType, shape ...int64) dev {
	t.Helper()
	n := int64(dt.Size())
	for _, s := range shape {
		n *= s
	}
	exit, err := e.be.Enter()
	require.NoError(t, err)
	p, err := e.drv.MemAlloc(int(max(n, 16)))
	exit()
	require.NoError(t, err)
	b, err := e.drv.Bytes(p, int(max(n, 16)))
	require.NoError(t, err)
	for i := range b {
		b[i] = 0xcd // outputs start as garbage
	}
	ptr := *(*unsafe.Pointer)(unsafe.Pointer(&p))
	return dev{t: dlpack.Tensor{Valid: true, Data: ptr, DeviceType: dlpack.CUDA, DeviceID: e.r, DType: dt, Shape: shape}, b: b[:n]}
}

func (e *rankEnv) upload(t *testing.T, dt dlpack.DType, data []byte, shape ...int64) dev {
	d := e.alloc(t, dt, shape...)
	copy(d.b, data)
	return d
}

func none() dev { return dev{} }

// columnMajor uploads row-major float32 rows [T, S] column-major, each column padded by pad
// words of garbage (strides (1, T + pad)).
func (e *rankEnv) columnMajor(t *testing.T, rows []float32, T, S, pad int) dev {
	ld := T + pad
	cols := make([]float32, max(0, (S-1)*ld+T))
	for i := range cols {
		cols[i] = -7
	}
	for tok := 0; tok < T; tok++ {
		for j := 0; j < S; j++ {
			cols[j*ld+tok] = rows[tok*S+j]
		}
	}
	d := e.upload(t, dlpack.F32, bytesOf(cols), int64(len(cols)))
	d.t.Shape, d.t.Strides = []int64{int64(T), int64(S)}, []int64{1, int64(ld)}
	return d
}

// scaleStrides are the strides of x_scales for a DispatchOp, in words (0, 0: dense rows).
func (c rcase) scaleStrides(T int) (int, int) {
	if !c.colScales {
		return 0, 0
	}
	return 1, T + c.scalePad
}

func i32s(b []byte) []int32 {
	if len(b) == 0 {
		return []int32{}
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&b[0])), len(b)/4)
}
func i64s(b []byte) []int64 {
	if len(b) == 0 {
		return []int64{}
	}
	return unsafe.Slice((*int64)(unsafe.Pointer(&b[0])), len(b)/8)
}
func f32s(b []byte) []float32 {
	if len(b) == 0 {
		return []float32{}
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4)
}
func bools(b []byte) []bool {
	if len(b) == 0 {
		return []bool{}
	}
	return unsafe.Slice((*bool)(unsafe.Pointer(&b[0])), len(b))
}
func bytesOf[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(z)))
}

// each runs f for every rank concurrently.
func each(R int, f func(r int) error) []error {
	errs := make([]error, R)
	var wg sync.WaitGroup
	for r := 0; r < R; r++ {
		wg.Add(1)
		go func() { defer wg.Done(); errs[r] = f(r) }()
	}
	wg.Wait()
	return errs
}

func noErrors(t *testing.T, errs []error) {
	t.Helper()
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// refDomain is goep/normal's simulated domain for the reference.
func refDomain(R int, numBytes int64) []*normal.Domain {
	ctls := make([]unsafe.Pointer, R)
	bufs := make([]unsafe.Pointer, R)
	for r := 0; r < R; r++ {
		c := make([]uint64, normal.ControlBytes/8)
		b := make([]uint64, numBytes/8)
		ctls[r], bufs[r] = unsafe.Pointer(&c[0]), unsafe.Pointer(&b[0])
	}
	doms := make([]*normal.Domain, R)
	for r := range doms {
		doms[r] = &normal.Domain{Rank: r, NumRanks: R, Buffers: bufs, Controls: ctls, NumBytes: numBytes, Timeout: emuWaitTimeout}
	}
	return doms
}

type rcase struct {
	name       string
	R, T, E, K int
	hidden     int          // elements
	dtype      dlpack.DType // of x (FP8: scales too)
	scales     int          // floats per row (FP8)
	cfg        goep.Config
	worst      int // extra rows beyond the largest receive; 0: none
	align      int
	bias       int
	combineDT  dlpack.DType // of combine's rows (bf16 for FP8)
	tokensPer  func(r int) int
	silent     int // 0, or 1 + a rank whose tokens go nowhere

	// colScales: the kernel reads the scales column-major, each column padded by scalePad words
	// (DeepEP's callers pass them so); the reference reads them row-major.
	colScales bool
	scalePad  int
}

func cfg(sms, send, recv int) goep.Config {
	c, err := goep.NewConfig(sms, send, recv, 6, 128)
	if err != nil {
		panic(err)
	}
	return c
}

// inputs of rank r: topk [T, K], weights [T, K], x rows, scales.
func (c rcase) inputs(r int) (topk []int64, w []float32, x []byte, scales []float32) {
	rng := rand.New(rand.NewPCG(uint64(r)+1, 7))
	T := c.tokens(r)
	topk = make([]int64, T*c.K)
	w = make([]float32, T*c.K)
	for t := 0; t < T; t++ {
		perm := rng.Perm(c.E)
		for k := 0; k < c.K; k++ {
			e := int64(-1)
			if k < c.E && rng.Float64() > 0.15 && r+1 != c.silent {
				e = int64(perm[k])
			}
			topk[t*c.K+k] = e
			w[t*c.K+k] = rng.Float32()
		}
	}
	es := c.dtype.Size()
	x = make([]byte, T*c.hidden*es)
	for i := 0; i < T*c.hidden; i++ {
		if c.dtype == dlpack.BF16 || c.dtype == dlpack.F16 || c.dtype == dlpack.F32 {
			putFloat(x, c.dtype, i, float32(rng.NormFloat64()*3))
		} else {
			_ = rng.NormFloat64()             // the same draws whatever the dtype
			x[i] = byte(rng.IntN(256) & 0x77) // finite e4m3 patterns
		}
	}
	if c.scales > 0 {
		scales = make([]float32, T*c.scales)
		for i := range scales {
			scales[i] = rng.Float32() + 0.5
		}
	}
	return
}

func (c rcase) tokens(r int) int {
	if c.tokensPer != nil {
		return c.tokensPer(r)
	}
	return c.T
}

func normalDType(d dlpack.DType) normal.DType {
	switch d {
	case dlpack.F16:
		return normal.Float16
	case dlpack.F32:
		return normal.Float32
	}
	return normal.BFloat16
}

// putFloat stores v as element i of b, a tensor of dtype BF16, F16 or F32 (rounded as PyTorch does).
func putFloat(b []byte, dtype dlpack.DType, i int, v float32) {
	switch dtype {
	case dlpack.BF16:
		binary.LittleEndian.PutUint16(b[2*i:], normal.F32ToBF16(v))
	case dlpack.F16:
		binary.LittleEndian.PutUint16(b[2*i:], normal.F32ToF16(v))
	default:
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
}
