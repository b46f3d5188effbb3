//go:build cgo

package emu_test

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
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
		v := float32(rng.NormFloat64() * 3)
		switch c.dtype {
		case dlpack.BF16:
			binary.LittleEndian.PutUint16(x[2*i:], normal.F32ToBF16(v))
		case dlpack.F16:
			binary.LittleEndian.PutUint16(x[2*i:], normal.F32ToF16(v))
		case dlpack.F32:
			binary.LittleEndian.PutUint32(x[4*i:], math.Float32bits(v))
		default:
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

func runCase(t *testing.T, envs []*rankEnv, c rcase) {
	R, K, E := c.R, c.K, c.E
	C := c.cfg.NumChannels()
	topo := make([]goep.Topology, R)
	peers := make([][]goep.Region, R)
	for r, e := range envs {
		topo[r] = e.buf.Topology()
		var err error
		peers[r], err = e.buf.Peers()
		require.NoError(t, err)
	}
	type rankData struct {
		topk                                           []int64
		w, scales                                      []float32
		x                                              []byte
		T                                              int
		dTopk, dW, dX, dSc                             dev
		perRank, perExpert, inRank                     dev
		rankPrefix, channelPrefix, recvChannelPrefix   dev
		recvPerExpert                                  dev
		n                                              int
		recvX, recvSc, recvSrc, recvTopk, recvW, sendH dev
	}
	rd := make([]*rankData, R)
	for r, e := range envs {
		d := &rankData{}
		d.topk, d.w, d.x, d.scales = c.inputs(r)
		d.T = c.tokens(r)
		T := int64(d.T)
		d.dTopk = e.upload(t, dlpack.I64, bytesOf(d.topk), T, int64(K))
		d.dW = e.upload(t, dlpack.F32, bytesOf(d.w), T, int64(K))
		d.dX = e.upload(t, c.dtype, d.x, T, int64(c.hidden))
		if c.scales > 0 {
			d.dSc = e.upload(t, dlpack.F32, bytesOf(d.scales), T, int64(c.scales))
			if c.colScales {
				d.dSc = e.columnMajor(t, d.scales, d.T, c.scales, c.scalePad)
			}
		}
		d.perRank = e.alloc(t, dlpack.I32, int64(R))
		d.perExpert = e.alloc(t, dlpack.I32, int64(E))
		d.inRank = e.alloc(t, dlpack.BoolT, T, int64(R))
		rd[r] = d
	}

	// Layout.
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		return envs[r].normal().Layout(&goep.LayoutOp{NumExperts: E, NumRanks: R, TopkIdx: d.dTopk.t, PerRank: d.perRank.t,
			PerExpert: d.perExpert.t, InRank: d.inRank.t})
	}))
	for r, d := range rd {
		perRank, perExpert, inRank := make([]int32, R), make([]int32, E), make([]bool, d.T*R)
		require.NoError(t, normal.Layout(d.topk, d.T, K, E, R, perRank, perExpert, inRank))
		require.Equal(t, perRank, i32s(d.perRank.b), "rank %d per_rank", r)
		require.Equal(t, perExpert, i32s(d.perExpert.b), "rank %d per_expert", r)
		require.Equal(t, inRank, bools(d.inRank.b), "rank %d in_rank", r)
	}

	// Reference: notify, dispatch, cached dispatch, combine.
	refBytes, err := c.cfg.NVLBufferSizeHint(c.hidden*c.dtype.Size()+c.scales*4, R)
	require.NoError(t, err)
	doms := refDomain(R, max(64<<20, refBytes))
	type refOut struct {
		rankPrefix, channelPrefix, recvChannelPrefix, recvPerExpert []int32
		n                                                           int
		recvX                                                       []byte
		recvSc                                                      []byte
		recvSrc                                                     []int32
		recvTopk                                                    []int64
		recvW                                                       []float32
		sendHead                                                    []int32
		combined                                                    []byte
		combinedW                                                   []float32
		biases                                                      [][]byte
	}
	ref := make([]*refOut, R)
	ncfg := normal.Config{NumSMs: c.cfg.NumSMs, NumMaxNVLChunkedSendTokens: c.cfg.NumMaxNVLChunkedSendTokens,
		NumMaxNVLChunkedRecvTokens: c.cfg.NumMaxNVLChunkedRecvTokens}
	for r := range ref {
		ref[r] = &refOut{rankPrefix: make([]int32, R*R), channelPrefix: make([]int32, R*C), recvChannelPrefix: make([]int32, R*C),
			recvPerExpert: make([]int32, E/R)}
	}
	noErrors(t, each(R, func(r int) error {
		d, o := rd[r], ref[r]
		res, err := normal.Notify(doms[r], &normal.NotifyArgs{Config: ncfg, NumTokens: d.T, NumExperts: E, ExpertAlignment: c.align,
			NumTokensPerRank: i32s(d.perRank.b), NumTokensPerExpert: i32s(d.perExpert.b), IsTokenInRank: bools(d.inRank.b),
			RankPrefixMatrix: o.rankPrefix, ChannelPrefixMatrix: o.channelPrefix, RecvChannelPrefixMatrix: o.recvChannelPrefix,
			NumRecvTokensPerExpert: o.recvPerExpert})
		o.n = res.NumRecvTokens
		return err
	}))
	worst := 0
	if c.worst > 0 {
		for _, o := range ref {
			worst = max(worst, o.n)
		}
		worst += c.worst
	}
	es := c.dtype.Size()
	rowBytes := c.hidden * es
	noErrors(t, each(R, func(r int) error {
		d, o := rd[r], ref[r]
		rows := o.n
		if worst > 0 {
			rows = worst
		}
		o.recvX = make([]byte, rows*rowBytes)
		o.recvSc = make([]byte, rows*c.scales*4)
		o.recvSrc, o.recvTopk, o.recvW = make([]int32, rows), make([]int64, rows*K), make([]float32, rows*K)
		o.sendHead = make([]int32, d.T*R)
		var sc []byte
		if c.scales > 0 {
			sc = bytesOf(d.scales)
		} else {
			o.recvSc = nil
		}
		return normal.Dispatch(doms[r], &normal.DispatchArgs{Config: ncfg, NumTokens: d.T, HiddenBytes: rowBytes, ScalesBytes: c.scales * 4,
			NumTopk: K, NumExperts: E, X: d.x, XScales: sc, TopkIdx: d.topk, TopkWeights: d.w, IsTokenInRank: bools(d.inRank.b),
			RankPrefixMatrix: o.rankPrefix, ChannelPrefixMatrix: o.channelPrefix, NumWorstTokens: worst,
			RecvX: o.recvX, RecvXScales: o.recvSc, RecvSrcIdx: o.recvSrc, RecvTopkIdx: o.recvTopk, RecvTopkWeights: o.recvW,
			SendHead: o.sendHead})
	}))
	// Combine's rows: the received rows as the combine dtype (bf16 for FP8), scaled per rank.
	cdt := c.combineDT
	if cdt == (dlpack.DType{}) {
		cdt = c.dtype
	}
	ces := cdt.Size()
	combineRows := func(r int, recv []byte, rows int) []byte {
		out := make([]byte, rows*c.hidden*ces)
		for i := 0; i < rows*c.hidden; i++ {
			var v float32
			switch c.dtype {
			case dlpack.BF16:
				v = normal.BF16ToF32(binary.LittleEndian.Uint16(recv[2*i:]))
			case dlpack.F16:
				v = normal.F16ToF32(binary.LittleEndian.Uint16(recv[2*i:]))
			case dlpack.F32:
				v = math.Float32frombits(binary.LittleEndian.Uint32(recv[4*i:]))
			default:
				v = float32(int8(recv[i])) / 8
			}
			v *= float32(r+1) / 4
			switch cdt {
			case dlpack.BF16:
				binary.LittleEndian.PutUint16(out[2*i:], normal.F32ToBF16(v))
			case dlpack.F16:
				binary.LittleEndian.PutUint16(out[2*i:], normal.F32ToF16(v))
			default:
				binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
			}
		}
		return out
	}
	noErrors(t, each(R, func(r int) error {
		d, o := rd[r], ref[r]
		rows := len(o.recvSrc)
		y := combineRows(r, o.recvX, rows)
		rng := rand.New(rand.NewPCG(uint64(r)+100, 9))
		for i := 0; i < c.bias; i++ {
			b := make([]byte, d.T*c.hidden*ces)
			for j := 0; j < d.T*c.hidden; j++ {
				v := float32(rng.NormFloat64())
				switch cdt {
				case dlpack.BF16:
					binary.LittleEndian.PutUint16(b[2*j:], normal.F32ToBF16(v))
				case dlpack.F16:
					binary.LittleEndian.PutUint16(b[2*j:], normal.F32ToF16(v))
				default:
					binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(v))
				}
			}
			o.biases = append(o.biases, b)
		}
		var b0, b1 []byte
		if c.bias > 0 {
			b0 = o.biases[0]
		}
		if c.bias > 1 {
			b1 = o.biases[1]
		}
		o.combined = make([]byte, d.T*c.hidden*ces)
		o.combinedW = make([]float32, d.T*K)
		return normal.Combine(doms[r], &normal.CombineArgs{Config: ncfg, DType: normalDType(cdt), Hidden: c.hidden, NumTopk: K,
			NumTokens: d.T, X: y, TopkWeights: o.recvW, SrcIdx: o.recvSrc, RankPrefixMatrix: o.rankPrefix,
			ChannelPrefixMatrix: o.recvChannelPrefix, SendHead: o.sendHead, Bias0: b0, Bias1: b1,
			CombinedX: o.combined, CombinedTopkWeights: o.combinedW})
	}))

	// The GPU path.
	for r, e := range envs {
		d := rd[r]
		d.rankPrefix = e.alloc(t, dlpack.I32, int64(R), int64(R))
		d.channelPrefix = e.alloc(t, dlpack.I32, int64(R), int64(C))
		d.recvChannelPrefix = e.alloc(t, dlpack.I32, int64(R), int64(C))
		d.recvPerExpert = e.alloc(t, dlpack.I32, int64(E/R))
	}
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		n, err := envs[r].normal().Notify(peers[r], &goep.NotifyOp{Config: c.cfg, NumTokens: d.T, NumExperts: E,
			ExpertAlignment: c.align, NumWorstTokens: worst, PerRank: d.perRank.t, PerExpert: d.perExpert.t, InRank: d.inRank.t,
			RankPrefix: d.rankPrefix.t, ChannelPrefix: d.channelPrefix.t, RecvChannelPrefix: d.recvChannelPrefix.t,
			RecvPerExpert: d.recvPerExpert.t, TopkIdx: d.dTopk.t})
		d.n = n
		return err
	}))
	for r, d := range rd {
		o := ref[r]
		require.Equal(t, o.n, d.n, "rank %d num_recv", r)
		require.Equal(t, o.rankPrefix, i32s(d.rankPrefix.b), "rank %d rank_prefix", r)
		require.Equal(t, o.channelPrefix, i32s(d.channelPrefix.b), "rank %d channel_prefix", r)
		require.Equal(t, o.recvChannelPrefix, i32s(d.recvChannelPrefix.b), "rank %d recv_channel_prefix", r)
		require.Equal(t, o.recvPerExpert, i32s(d.recvPerExpert.b), "rank %d recv_per_expert", r)
		host, err := envs[r].normal().(goep.PerExpertCounter).RecvPerExpert()
		require.NoError(t, err)
		require.Equal(t, o.recvPerExpert, host, "rank %d recv_per_expert (host copy)", r)
	}
	for r, e := range envs {
		d := rd[r]
		rows := int64(d.n)
		if worst > 0 {
			rows = int64(worst)
		}
		d.recvX = e.alloc(t, c.dtype, rows, int64(c.hidden))
		if c.scales > 0 {
			d.recvSc = e.alloc(t, dlpack.F32, rows, int64(c.scales))
		}
		d.recvSrc = e.alloc(t, dlpack.I32, rows)
		d.recvTopk = e.alloc(t, dlpack.I64, rows, int64(K))
		d.recvW = e.alloc(t, dlpack.F32, rows, int64(K))
		d.sendH = e.alloc(t, dlpack.I32, int64(d.T), int64(R))
	}
	launched := make([]int64, R)
	for r, e := range envs {
		launched[r] = e.be.LastLaunchNS()
	}
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		st, ss := c.scaleStrides(d.T)
		return envs[r].normal().Dispatch(peers[r], &goep.DispatchOp{Config: c.cfg, NumTokens: d.T, HiddenBytes: rowBytes,
			ScalesBytes: c.scales * 4, ScalesTokenStride: st, ScalesStride: ss, NumTopk: K, NumExperts: E, NumWorstTokens: worst,
			X: d.dX.t, XScales: d.dSc.t,
			TopkIdx: d.dTopk.t, TopkWeights: d.dW.t, InRank: d.inRank.t, RankPrefix: d.rankPrefix.t, ChannelPrefix: d.channelPrefix.t,
			RecvX: d.recvX.t, RecvXScales: d.recvSc.t, RecvSrcIdx: d.recvSrc.t, RecvTopkIdx: d.recvTopk.t,
			RecvTopkWeights: d.recvW.t, SendHead: d.sendH.t})
	}))
	for r, e := range envs {
		assert.Greater(t, e.be.LastLaunchNS(), launched[r], "rank %d: the dispatch's launch is stamped", r)
	}
	for r, d := range rd {
		o := ref[r]
		require.Equal(t, o.recvX, d.recvX.b, "rank %d recv_x", r)
		if c.scales > 0 {
			require.Equal(t, o.recvSc, d.recvSc.b, "rank %d recv_x_scales", r)
		}
		require.Equal(t, o.recvSrc, i32s(d.recvSrc.b), "rank %d recv_src_idx", r)
		require.Equal(t, o.recvTopk, i64s(d.recvTopk.b), "rank %d recv_topk_idx", r)
		require.Equal(t, o.recvW, f32s(d.recvW.b), "rank %d recv_topk_weights", r)
		require.Equal(t, o.sendHead, i32s(d.sendH.b), "rank %d send_head", r)
	}

	// Cached dispatch: the same rows again.
	cached := make([]dev, R)
	for r, e := range envs {
		cached[r] = e.alloc(t, c.dtype, int64(len(ref[r].recvSrc)), int64(c.hidden))
	}
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		return envs[r].normal().Dispatch(peers[r], &goep.DispatchOp{Config: c.cfg, NumTokens: d.T, HiddenBytes: rowBytes,
			NumWorstTokens: worst, X: d.dX.t, InRank: d.inRank.t, RankPrefix: d.rankPrefix.t, ChannelPrefix: d.channelPrefix.t,
			RecvX: cached[r].t})
	}))
	for r := range rd {
		require.Equal(t, ref[r].recvX, cached[r].b, "rank %d cached recv_x", r)
	}
	if worst == 0 {
		runQueued(t, envs, c, topo, peers, func(r int) (queuedIn, queuedOut) {
			d, o := rd[r], ref[r]
			return queuedIn{T: d.T, x: d.dX, sc: d.dSc, topk: d.dTopk, w: d.dW, perRank: d.perRank, perExpert: d.perExpert,
					inRank: d.inRank},
				queuedOut{n: o.n, recvX: o.recvX, recvSc: o.recvSc, recvSrc: o.recvSrc, recvTopk: o.recvTopk, recvW: o.recvW,
					sendHead: o.sendHead}
		})
	}

	// Combine.
	outs := make([]dev, R)
	outW := make([]dev, R)
	ys := make([]dev, R)
	biases := make([][2]dev, R)
	for r, e := range envs {
		d, o := rd[r], ref[r]
		rows := int64(len(o.recvSrc))
		ys[r] = e.upload(t, cdt, combineRows(r, d.recvX.b, int(rows)), rows, int64(c.hidden))
		for i, b := range o.biases {
			biases[r][i] = e.upload(t, cdt, b, int64(d.T), int64(c.hidden))
		}
		outs[r] = e.alloc(t, cdt, int64(d.T), int64(c.hidden))
		outW[r] = e.alloc(t, dlpack.F32, int64(d.T), int64(K))
	}
	noErrors(t, each(R, func(r int) error {
		d := rd[r]
		return envs[r].normal().Combine(peers[r], &goep.CombineOp{Config: c.cfg, NumTokens: d.T, Hidden: c.hidden, NumTopk: K,
			X: ys[r].t, TopkWeights: d.recvW.t, SrcIdx: d.recvSrc.t, RankPrefix: d.rankPrefix.t, ChannelPrefix: d.recvChannelPrefix.t,
			SendHead: d.sendH.t, Bias0: biases[r][0].t, Bias1: biases[r][1].t, CombinedX: outs[r].t, CombinedTopkWeights: outW[r].t})
	}))
	for r := range rd {
		require.Equal(t, ref[r].combined, outs[r].b, "rank %d combined_x", r)
		require.Equal(t, ref[r].combinedW, f32s(outW[r].b), "rank %d combined_topk_weights", r)
	}
}

var bf16 = dlpack.BF16

func TestEmulatedRoundTrip(t *testing.T) {
	cases := []rcase{
		{name: "bf16_R2", R: 2, T: 70, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 2},
		{name: "bf16_R2_one_channel_big_ring", R: 2, T: 33, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(2, 6, 256), align: 4, bias: 1},
		{name: "bf16_R2_worst_uneven", R: 2, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(6, 3, 7), align: 1, worst: 3,
			tokensPer: func(r int) int { return []int{50, 0}[r] }},
		{name: "fp8_R2", R: 2, T: 40, E: 8, K: 4, hidden: 256, dtype: dlpack.FP8E4M3, scales: 2, cfg: cfg(4, 2, 8), align: 1,
			combineDT: bf16, bias: 0},
		{name: "fp8_R2_column_major_scales", R: 2, T: 37, E: 8, K: 4, hidden: 256, dtype: dlpack.FP8E4M3, scales: 2,
			colScales: true, scalePad: 3, cfg: cfg(4, 2, 8), align: 1, combineDT: bf16},
		{name: "odd_hidden_R2", R: 2, T: 45, E: 4, K: 3, hidden: 99, dtype: bf16, cfg: cfg(4, 3, 10), align: 1, bias: 1},
		{name: "f32_R2", R: 2, T: 30, E: 6, K: 4, hidden: 64, dtype: dlpack.F32, cfg: cfg(2, 2, 5), align: 1, bias: 2},
		{name: "bf16_R3_silent", R: 3, T: 50, E: 9, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1, silent: 2},
		// Any shape builds at its first launch: rows of 7168 bytes and an odd top-k, which no
		// kernel built ahead of time had.
		{name: "bf16_R2_hidden_3584_top5", R: 2, T: 24, E: 10, K: 5, hidden: 3584, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			envs := newDomain(t, c.R, 8<<20)
			runCase(t, envs, c)
			// The buffer works again for a second round (counters reset, barriers numbered on).
			runCase(t, envs, c)
		})
	}
}

// TestEmulatedUseFabric: the kernels over use_fabric buffers, cuMem memory that each rank
// maps at its own address, shared through file descriptors or fabric handles.
func TestEmulatedUseFabric(t *testing.T) {
	c := rcase{name: "bf16_R3", R: 3, T: 50, E: 9, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}
	for _, mode := range []string{"fd", "fabric"} {
		t.Run(mode, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, mode)
			envs := newDomainOf(t, c.R, 8<<20, emu.Options(), true)
			runCase(t, envs, c)
		})
	}
}

// notifyOps makes every rank's inputs of c and its layout, and returns notify arguments.
func notifyOps(t *testing.T, envs []*rankEnv, c rcase) []*goep.NotifyOp {
	R, K, E, C := c.R, c.K, c.E, c.cfg.NumChannels()
	ops := make([]*goep.NotifyOp, R)
	for r, e := range envs {
		topk, _, _, _ := c.inputs(r)
		T := int64(c.tokens(r))
		dTopk := e.upload(t, dlpack.I64, bytesOf(topk), T, int64(K))
		op := &goep.NotifyOp{Config: c.cfg, NumTokens: int(T), NumExperts: E, ExpertAlignment: 1, TopkIdx: dTopk.t,
			PerRank: e.alloc(t, dlpack.I32, int64(R)).t, PerExpert: e.alloc(t, dlpack.I32, int64(E)).t,
			InRank: e.alloc(t, dlpack.BoolT, T, int64(R)).t, RankPrefix: e.alloc(t, dlpack.I32, int64(R), int64(R)).t,
			ChannelPrefix: e.alloc(t, dlpack.I32, int64(R), int64(C)).t, RecvChannelPrefix: e.alloc(t, dlpack.I32, int64(R), int64(C)).t,
			RecvPerExpert: e.alloc(t, dlpack.I32, int64(E/R)).t}
		require.NoError(t, e.normal().Layout(&goep.LayoutOp{NumExperts: E, NumRanks: R, TopkIdx: dTopk.t, PerRank: op.PerRank,
			PerExpert: op.PerExpert, InRank: op.InRank}))
		ops[r] = op
	}
	return ops
}

func notifyAll(envs []*rankEnv, ops []*goep.NotifyOp, only ...int) []error {
	return each(len(envs), func(r int) error {
		if len(only) > 0 && only[0] != r {
			return nil
		}
		peers, err := envs[r].buf.Peers()
		if err != nil {
			return err
		}
		_, err = envs[r].normal().Notify(peers, ops[r])
		return err
	})
}

func TestEmulatedErrors(t *testing.T) {
	c := rcase{R: 2, T: 40, E: 8, K: 4, hidden: 256, dtype: bf16, cfg: cfg(4, 2, 8), align: 1, bias: 1}
	envs := newDomain(t, c.R, 8<<20)

	// An expert index out of range on rank 1: rank 1 says which, rank 0 names rank 1.
	ops := notifyOps(t, envs, c)
	bad := unsafe.Slice((*int64)(ops[1].TopkIdx.Data), c.T*c.K)
	bad[3*c.K+2] = 13
	errs := notifyAll(envs, ops)
	require.Error(t, errs[1])
	assert.True(t, goep.IsArgument(errs[1]))
	assert.Contains(t, errs[1].Error(), "topk_idx[3,2] = 13 is out of range [0, 8)")
	require.Error(t, errs[0])
	assert.False(t, goep.IsArgument(errs[0]))
	assert.Contains(t, errs[0].Error(), "rank 1 has invalid arguments")
	assert.Contains(t, errs[0].Error(), "topk_idx[3,2] = 13")

	// The buffer still works.
	runCase(t, envs, c)

	// A bad index given to the layout (which does not wait for the GPU) fails the next notify,
	// here one without topk_idx, on every rank; a later layout's record replaces it.
	ops = notifyOps(t, envs, c)
	lbad := envs[0].upload(t, dlpack.I64, bytesOf([]int64{0, 1, 2, 3, 4, 5, 6, -1, -1, 99, 0, 1}), 3, 4)
	require.NoError(t, envs[0].normal().Layout(&goep.LayoutOp{NumExperts: c.E, NumRanks: c.R, TopkIdx: lbad.t,
		PerRank: envs[0].alloc(t, dlpack.I32, int64(c.R)).t, PerExpert: envs[0].alloc(t, dlpack.I32, int64(c.E)).t,
		InRank: envs[0].alloc(t, dlpack.BoolT, 3, int64(c.R)).t}))
	for _, op := range ops {
		op.TopkIdx = dlpack.Tensor{}
	}
	errs = notifyAll(envs, ops)
	require.Error(t, errs[0])
	assert.True(t, goep.IsArgument(errs[0]))
	assert.Contains(t, errs[0].Error(), "in its last get_dispatch_layout, topk_idx[2,1] = 99 is out of range [0, 8)")
	require.Error(t, errs[1])
	assert.Contains(t, errs[1].Error(), "rank 0 has invalid arguments")
	runCase(t, envs, c)

	// num_worst_tokens too small: the same error everywhere.
	ops = notifyOps(t, envs, c)
	for _, op := range ops {
		op.NumWorstTokens = 1
	}
	for r, err := range notifyAll(envs, ops) {
		require.Error(t, err, "rank %d", r)
		assert.True(t, goep.IsArgument(err))
		assert.Contains(t, err.Error(), "num_worst_tokens = 1 is too small: rank")
	}
	runCase(t, envs, c)

	// A buffer too small for the rings says so before anything moves.
	small := newDomain(t, c.R, 4096)
	sops := notifyOps(t, small, c)
	noErrors(t, notifyAll(small, sops))
	for r, err := range each(c.R, func(r int) error {
		peers, _ := small[r].buf.Peers()
		return small[r].normal().Dispatch(peers, &goep.DispatchOp{Config: c.cfg, HiddenBytes: 512})
	}) {
		require.Error(t, err, "rank %d", r)
		assert.True(t, goep.IsArgument(err))
		assert.Contains(t, err.Error(), "num_nvl_bytes = 4096 is too small")
	}

	// Rank 1 never calls: rank 0's notify times out naming it; then rank 1's call and every
	// later one fail at once.
	goep.SetOpTimeout(300 * time.Millisecond)
	defer goep.SetOpTimeout(20 * time.Second)
	ops = notifyOps(t, envs, c)
	start := time.Now()
	errs = notifyAll(envs, ops, 0)
	require.Error(t, errs[0])
	t.Log(errs[0])
	assert.Contains(t, errs[0].Error(), "timed out after")
	assert.Contains(t, errs[0].Error(), "waiting for rank 1 to join the call")
	assert.Less(t, time.Since(start), 5*time.Second)
	errs = notifyAll(envs, ops, 1)
	require.Error(t, errs[1])
	t.Log(errs[1])
	assert.Contains(t, errs[1].Error(), "stopped because rank 0 timed out waiting for rank 1")
	errs = notifyAll(envs, ops, 0)
	require.Error(t, errs[0])
	assert.Contains(t, errs[0].Error(), "failed earlier")
}

// Four ranks at a GPU run's shape: DeepEP's config of 20 SMs, hidden 2880.
func TestEmulatedFourRanks(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of threads")
	}
	c := rcase{name: "hidden_2880_R4", R: 4, T: 48, E: 16, K: 8, hidden: 2880, dtype: bf16, cfg: cfg(20, 6, 256), align: 1, bias: 2}
	envs := newDomainWith(t, c.R, 96<<20, emu.Options4())
	runCase(t, envs, c)
}

// Four ranks with the GPU's block size (24 warps: five sub-rings a ring), one channel: slow.
// The ring of 3 slots has fewer slots than a peer has sending warps (three sub-rings of one).
func TestEmulatedGPUBlocks(t *testing.T) {
	if os.Getenv("PYEP_EMU_SLOW") == "" {
		t.Skip("set PYEP_EMU_SLOW=1: thousands of threads")
	}
	sms := 2
	if v, err := strconv.Atoi(os.Getenv("PYEP_EMU_SMS")); err == nil {
		sms = v
	}
	for _, ring := range []int{256, 3} {
		c := rcase{name: fmt.Sprintf("hidden_2880_R4_768_ring%d", ring), R: 4, T: 48, E: 16, K: 8, hidden: 2880, dtype: bf16,
			cfg: cfg(sms, 2, ring), align: 1, bias: 2}
		t.Run(c.name, func(t *testing.T) {
			envs := newDomainWith(t, c.R, 96<<20, emu.OptionsGPU())
			runCase(t, envs, c)
		})
	}
}

type queuedIn struct {
	T                                          int
	x, sc, topk, w, perRank, perExpert, inRank dev
}

type queuedOut struct {
	n             int
	recvX, recvSc []byte
	recvSrc       []int32
	recvTopk      []int64
	recvW         []float32
	sendHead      []int32
}

// runQueued checks NotifyDispatch against the reference: once with room for every rank's rows
// (the dispatch runs), once with one row each (it runs only if no rank receives more; otherwise
// nothing moves, and a Dispatch into exact rows follows, as after Notify).
func runQueued(t *testing.T, envs []*rankEnv, c rcase, topo []goep.Topology, peers [][]goep.Region, of func(r int) (queuedIn, queuedOut)) {
	R, K, E, C := c.R, c.K, c.E, c.cfg.NumChannels()
	rowBytes := c.hidden * c.dtype.Size()
	for _, spare := range []int{3, -1} {
		capOf := func(r int) int {
			if spare < 0 {
				return 1
			}
			_, want := of(r)
			return want.n + spare
		}
		fit := true
		for r := range envs {
			_, want := of(r)
			fit = fit && want.n <= capOf(r)
		}
		type outs struct{ recvX, recvSc, recvSrc, recvTopk, recvW, sendH, rp, cp, rcp, rpe dev }
		alloc := func(e *rankEnv, rows int64, T int) outs {
			var o outs
			o.recvX = e.alloc(t, c.dtype, rows, int64(c.hidden))
			if c.scales > 0 {
				o.recvSc = e.alloc(t, dlpack.F32, rows, int64(c.scales))
			}
			o.recvSrc = e.alloc(t, dlpack.I32, rows)
			o.recvTopk = e.alloc(t, dlpack.I64, rows, int64(K))
			o.recvW = e.alloc(t, dlpack.F32, rows, int64(K))
			o.sendH = e.alloc(t, dlpack.I32, int64(T), int64(R))
			o.rp = e.alloc(t, dlpack.I32, int64(R), int64(R))
			o.cp = e.alloc(t, dlpack.I32, int64(R), int64(C))
			o.rcp = e.alloc(t, dlpack.I32, int64(R), int64(C))
			o.rpe = e.alloc(t, dlpack.I32, int64(E/R))
			return o
		}
		op := func(in queuedIn, o outs) *goep.DispatchOp {
			st, ss := c.scaleStrides(in.T)
			return &goep.DispatchOp{Config: c.cfg, NumTokens: in.T, HiddenBytes: rowBytes, ScalesBytes: c.scales * 4,
				ScalesTokenStride: st, ScalesStride: ss, NumTopk: K,
				NumExperts: E, X: in.x.t, XScales: in.sc.t, TopkIdx: in.topk.t, TopkWeights: in.w.t, InRank: in.inRank.t,
				RankPrefix: o.rp.t, ChannelPrefix: o.cp.t, RecvX: o.recvX.t, RecvXScales: o.recvSc.t, RecvSrcIdx: o.recvSrc.t,
				RecvTopkIdx: o.recvTopk.t, RecvTopkWeights: o.recvW.t, SendHead: o.sendH.t}
		}
		got := make([]outs, R)
		ns, ran := make([]int, R), make([]bool, R)
		for r, e := range envs {
			in, _ := of(r)
			got[r] = alloc(e, int64(capOf(r)), in.T)
		}
		noErrors(t, each(R, func(r int) error {
			in, _ := of(r)
			o := got[r]
			var err error
			ns[r], ran[r], err = envs[r].normal().(goep.SpeculativeEngine).NotifyDispatch(peers[r], &goep.NotifyOp{Config: c.cfg, NumTokens: in.T,
				NumExperts: E, ExpertAlignment: c.align, PerRank: in.perRank.t, PerExpert: in.perExpert.t, InRank: in.inRank.t,
				RankPrefix: o.rp.t, ChannelPrefix: o.cp.t, RecvChannelPrefix: o.rcp.t, RecvPerExpert: o.rpe.t,
				TopkIdx: in.topk.t, Capacity: capOf(r)}, op(in, o))
			return err
		}))
		for r := range envs {
			_, want := of(r)
			require.Equal(t, want.n, ns[r], "rank %d num_recv (spare %d)", r, spare)
			require.Equal(t, fit, ran[r], "rank %d: the dispatch ran (spare %d)", r, spare)
		}
		if !fit {
			exact := make([]outs, R)
			for r, e := range envs {
				in, _ := of(r)
				exact[r] = alloc(e, int64(ns[r]), in.T)
				exact[r].rp, exact[r].cp = got[r].rp, got[r].cp
			}
			noErrors(t, each(R, func(r int) error {
				in, _ := of(r)
				return envs[r].normal().Dispatch(peers[r], op(in, exact[r]))
			}))
			got = exact
		}
		for r := range envs {
			_, want := of(r)
			n, o := want.n, got[r]
			require.Equal(t, want.recvX, o.recvX.b[:n*rowBytes], "rank %d queued recv_x (spare %d)", r, spare)
			if c.scales > 0 {
				require.Equal(t, want.recvSc, o.recvSc.b[:n*c.scales*4], "rank %d queued recv_x_scales", r)
			}
			require.Equal(t, want.recvSrc, i32s(o.recvSrc.b)[:n], "rank %d queued recv_src_idx", r)
			require.Equal(t, want.recvTopk, i64s(o.recvTopk.b)[:n*K], "rank %d queued recv_topk_idx", r)
			require.Equal(t, want.recvW, f32s(o.recvW.b)[:n*K], "rank %d queued recv_topk_weights", r)
			require.Equal(t, want.sendHead, i32s(o.sendH.b), "rank %d queued send_head", r)
		}
	}
}
