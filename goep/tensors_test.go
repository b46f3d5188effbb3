package goep

import (
	"slices"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/dlpack"
)

// ownBuf is memory at a fixed address (a test's stack may move), as a tensor's is.
var ownBuf [12]int32

func TestTensorsOwn(t *testing.T) {
	buf := ownBuf[:]
	addr := uintptr(unsafe.Pointer(&buf[0]))
	tests := []struct {
		name     string
		data     uintptr
		optional bool
		dims     []int64
		valid    bool
		err      string
	}{
		{"present", addr, false, []int64{3, 4}, true, ""},
		{"absent optional", 0, true, []int64{3, 4}, false, ""},
		{"absent required", 0, false, []int64{3, 4}, false, "t: expected a tensor, got None"},
		// An empty tensor may have no address: it is present, with nothing to read or write.
		{"empty without address", 0, false, []int64{0, 4}, true, ""},
		{"negative size", addr, false, []int64{-1, 4}, false, "t: shape [-1 4] has a negative size"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := &Tensors{DeviceType: dlpack.CUDA, DeviceID: 2}
			got := ts.Own("t", tt.data, tt.optional, dlpack.I32, tt.dims...)
			if tt.err != "" {
				require.Error(t, ts.Err)
				assert.Contains(t, ts.Err.Error(), tt.err)
				assert.True(t, IsArgument(ts.Err))
				return
			}
			require.NoError(t, ts.Err)
			assert.Equal(t, tt.valid, got.Valid)
			if tt.valid {
				assert.Equal(t, tt.dims, got.Shape)
				assert.Equal(t, dlpack.I32, got.DType)
				assert.Equal(t, dlpack.CUDA, got.DeviceType)
				assert.Equal(t, 2, got.DeviceID)
			}
		})
	}
	// Once a tensor is wrong, later ones are not looked at: the first mistake is the one reported.
	ts := &Tensors{DeviceType: dlpack.CPU}
	ts.Own("a", 0, false, dlpack.I32, 2)
	assert.False(t, ts.Own("b", addr, false, dlpack.I32, 2).Valid)
	assert.Contains(t, ts.Err.Error(), "a: expected a tensor")
	// A present tensor views the memory at its address.
	ts = &Tensors{DeviceType: dlpack.CPU}
	buf[5] = 42
	assert.Equal(t, int32(42), Int32s(ts.Own("c", addr, false, dlpack.I32, 3, 4))[5])
}

func TestTensorsArg(t *testing.T) {
	buf := ownBuf[:]
	addr := uintptr(unsafe.Pointer(&buf[0]))
	cpu, meta, cuda1 := DeviceCode(CPUDevice, -1), DeviceCode(2, -1), DeviceCode(CUDADevice, 1)
	// A [3, 4] int32 tensor as the Python layer describes it.
	good := Desc{Data: addr, DType: 6, Device: cpu, NDim: 2, Size: [2]int64{3, 4}, Stride: [2]int64{4, 1}}
	with := func(f func(*Desc)) Desc { d := good; f(&d); return d }
	tests := []struct {
		name     string
		d        Desc
		optional bool
		dims     []int64
		err      string // "" for a valid tensor, "-" for an absent one
	}{
		{"valid", good, false, []int64{3, -1}, ""},
		{"None optional", Desc{NDim: NoneDim}, true, []int64{3, 4}, "-"},
		{"None required", Desc{NDim: NoneDim}, false, []int64{3, 4}, "t must be a torch.Tensor, got NoneType"},
		{"dtype", with(func(d *Desc) { d.DType = 7 }), false, []int64{3, 4}, "t: dtype torch.int64, expected torch.int32"},
		{"dtype unknown", with(func(d *Desc) { d.DType = -1 }), false, []int64{3, 4}, "t: dtype (a dtype unknown to pyep), expected torch.int32"},
		{"dtype without DLPack type", with(func(d *Desc) { d.DType = 20 }), false, []int64{3, 4}, "t: dtype torch.complex64, expected"},
		{"size", good, false, []int64{3, 5}, "t: shape [3, 4], expected [3, 5]"},
		{"dimensions", good, false, []int64{-1}, "t: shape [3, 4], expected [*]"},
		{"more dimensions than a Desc holds", with(func(d *Desc) { d.NDim = 3 }), false, []int64{-1, -1}, "t: shape [3, 4, ...], expected [*, *]"},
		{"zero dimensions", with(func(d *Desc) { d.NDim = 0 }), false, []int64{-1}, "t: shape [], expected [*]"},
		{"device", with(func(d *Desc) { d.Device = meta }), false, []int64{3, 4}, "t: on meta, expected cpu (the buffer's device)"},
		{"device index", with(func(d *Desc) { d.Device = cuda1 }), false, []int64{3, 4}, "t: on cuda:1, expected cpu"},
		{"transposed", with(func(d *Desc) { d.Stride = [2]int64{1, 3} }), false, []int64{3, 4}, "t: not contiguous; pass t.contiguous()"},
		{"row gap", with(func(d *Desc) { d.Stride = [2]int64{8, 1} }), false, []int64{3, 4}, "t: not contiguous"},
		// torch's is_contiguous(): a dimension of size 1 may have any stride, an empty tensor any strides.
		{"size-1 dimension", with(func(d *Desc) { d.Size, d.Stride = [2]int64{1, 4}, [2]int64{99, 1} }), false, []int64{1, 4}, ""},
		{"empty", with(func(d *Desc) { d.Data, d.Size, d.Stride = 0, [2]int64{0, 4}, [2]int64{1, 7} }), false, []int64{0, 4}, ""},
		{"no data", with(func(d *Desc) { d.Data = 0 }), false, []int64{3, 4}, "t: shape [3, 4] but no data"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := &Tensors{Device: cpu, DeviceType: dlpack.CPU}
			got := ts.Arg("t", tt.d, tt.optional, []dlpack.DType{dlpack.I32}, tt.dims...)
			switch tt.err {
			case "":
				require.NoError(t, ts.Err)
				assert.True(t, got.Valid)
				assert.Equal(t, tt.d.Size[:tt.d.NDim], got.Shape)
				assert.Equal(t, dlpack.I32, got.DType)
			case "-":
				require.NoError(t, ts.Err)
				assert.False(t, got.Valid)
			default:
				require.Error(t, ts.Err)
				assert.Contains(t, ts.Err.Error(), tt.err)
				assert.True(t, IsArgument(ts.Err))
				assert.Equal(t, tt.name == "None required", IsType(ts.Err))
				assert.False(t, got.Valid)
			}
		})
	}
	// The expected dtypes are listed by their torch names.
	ts := &Tensors{Device: cpu}
	ts.Arg("x", good, false, []dlpack.DType{dlpack.BF16, dlpack.F16, dlpack.F32})
	assert.EqualError(t, ts.Err, "x: dtype torch.int32, expected torch.bfloat16 or torch.float16 or torch.float32")
}

func TestTorchNamesMatchDLPack(t *testing.T) {
	// The types the core accepts sit at their torch names' index.
	for name, dt := range map[string]dlpack.DType{"float32": dlpack.F32, "float16": dlpack.F16, "bfloat16": dlpack.BF16,
		"int32": dlpack.I32, "int64": dlpack.I64, "bool": dlpack.BoolT, "float8_e4m3fn": dlpack.FP8E4M3} {
		i := slices.Index(DTypeNames, name)
		require.True(t, i >= 0 && i < len(dlpackOf), name)
		assert.Equal(t, dt, dlpackOf[i], name)
	}
	assert.Equal(t, "cpu", deviceName(DeviceCode(CPUDevice, -1)))
	assert.Equal(t, "cuda:3", deviceName(DeviceCode(CUDADevice, 3)))
	assert.Equal(t, "an unknown device", deviceName(DeviceCode(len(DeviceTypes), 0)))
}

func TestStreamOrderCheck(t *testing.T) {
	for flags, ok := range map[int]bool{0: true, OrderWait | OrderJoin: true, OrderOnComm | OrderPrevious: true,
		OrderOnComm: false, OrderOnComm | OrderPrevious | OrderJoin: false, OrderOnComm | OrderJoin: false} {
		err := StreamOrder{Flags: flags}.check()
		if ok {
			assert.NoError(t, err, "flags %d", flags)
		} else {
			assert.EqualError(t, err, "allocate_on_comm_stream=True needs previous_event and async_finish=True", "flags %d", flags)
		}
	}
}
