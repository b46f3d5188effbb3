package goep

import (
	"fmt"
	"slices"
	"strings"
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
)

// Desc is a caller's tensor as the Python layer reads it off the torch.Tensor: plain integers,
// checked here once (Tensors.Arg) against what the call expects. Making a DLPack capsule for it
// instead cost 1-2 µs of Python a tensor on the GPU hosts.
type Desc struct {
	Data   uintptr  // data_ptr(): the first element (0 for an empty tensor, or one without storage)
	DType  int      // the dtype's index in DTypeNames, -1 for one unknown here
	Device int      // DeviceCode of its device
	NDim   int      // NoneDim for None
	Size   [2]int64 // the first two sizes
	Stride [2]int64 // and strides, in elements
}

// NoneDim is a Desc's NDim for None.
const NoneDim = -1

// DTypeNames are torch's dtypes (torch.<name>), by the index a Desc gives; those with a DLPack
// type can be accepted, the others only named.
var DTypeNames = []string{
	"float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
	"uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
	"float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
	"complex32", "complex64", "complex128", "bcomplex32", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
	"bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
	"int1", "int2", "int3", "int4", "int5", "int6", "int7", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
}

// dlpackOf is the DLPack type of each dtype of DTypeNames that pyep can take (the first 19). The
// 1-byte float types after float8_e5m2 (and float4_e2m1fn_x2, two values a byte) have no DLPack
// type of their own here: dispatch moves them as opaque bytes.
var dlpackOf = [...]dlpack.DType{
	dlpack.F32, {Code: dlpack.Float, Bits: 64}, dlpack.F16, dlpack.BF16,
	{Code: dlpack.Int, Bits: 8}, {Code: dlpack.Int, Bits: 16}, dlpack.I32, dlpack.I64,
	{Code: dlpack.UInt, Bits: 8}, {Code: dlpack.UInt, Bits: 16}, {Code: dlpack.UInt, Bits: 32}, {Code: dlpack.UInt, Bits: 64},
	dlpack.BoolT, dlpack.FP8E4M3, dlpack.FP8E5M2,
	opaqueByte, opaqueByte, opaqueByte, opaqueByte,
}

// opaqueByte is the element of a 1-byte dtype that only moves (see dlpackOf).
var opaqueByte = dlpack.DType{Code: dlpack.UInt, Bits: 8}

// DeviceTypes are torch's device types, by the index a DeviceCode gives.
var DeviceTypes = []string{"cpu", "cuda", "meta", "mps", "xpu", "hpu", "xla", "lazy", "ipu", "mtia", "privateuseone",
	"vulkan", "ve", "fpga", "maia", "hip", "mkldnn", "opengl", "opencl", "ideep", "metal"}

// DeviceCode is a device as one integer: the type's index in DeviceTypes and the device index
// (-1 for none), as torch.device(type, index) names it.
func DeviceCode(typ, index int) int { return typ<<16 | (index + 1) }

// The device types pyep's buffers live on.
const (
	CPUDevice  = 0
	CUDADevice = 1
)

func deviceName(code int) string {
	typ, index := code>>16, code&0xffff-1
	if typ < 0 || typ >= len(DeviceTypes) {
		return "an unknown device"
	}
	if index < 0 {
		return DeviceTypes[typ]
	}
	return fmt.Sprintf("%s:%d", DeviceTypes[typ], index)
}

func dtypeName(code int) string {
	if code < 0 || code >= len(DTypeNames) {
		return "(a dtype unknown to pyep)"
	}
	return "torch." + DTypeNames[code]
}

// dtypesText is the expected dtypes as the messages list them: "torch.a or torch.b".
func dtypesText(dtypes []dlpack.DType) string {
	names := make([]string, len(dtypes))
	for i, d := range dtypes {
		names[i] = d.String()
		for j, t := range dlpackOf {
			if t == d {
				names[i] = dtypeName(j)
			}
		}
	}
	return strings.Join(names, " or ")
}

func shapeText(d Desc) string {
	parts := make([]string, 0, 3)
	for i := 0; i < min(d.NDim, 2); i++ {
		parts = append(parts, fmt.Sprint(d.Size[i]))
	}
	if d.NDim > 2 {
		// A Desc carries two sizes: no argument of pyep has more dimensions.
		parts = append(parts, "...")
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func dimsText(dims []int64) string {
	parts := make([]string, len(dims))
	for i, d := range dims {
		parts[i] = "*"
		if d >= 0 {
			parts[i] = fmt.Sprint(d)
		}
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// Tensors checks one call's tensors and makes their views. The first mistake is kept (Err) and
// names the argument; later calls are no-ops, so a caller checks once.
//
// Two kinds of tensor cross. A caller's tensor comes as a Desc (Arg). A tensor that the pyep
// layer allocated itself (a call's outputs, a handle's tensors) comes as its bare data address
// (Own), in the shape that the core derives from the rest of the call.
type Tensors struct {
	Device     int // DeviceCode of the buffer's device, where every tensor must be
	DeviceType int // dlpack.CPU or dlpack.CUDA, of the views
	DeviceID   int
	Err        error

	// The shapes of the views, here so that a call's views cost no allocation each.
	dims [40]int64
	used int
}

// shape is dims, kept in ts.
func (ts *Tensors) shape(dims []int64) []int64 {
	n := len(dims)
	if ts.used+n > len(ts.dims) {
		return append([]int64(nil), dims...)
	}
	s := ts.dims[ts.used : ts.used+n : ts.used+n]
	copy(s, dims)
	ts.used += n
	return s
}

// Arg checks a caller's tensor: present (unless optional), of one of dtypes (nil: any dtype
// pyep can take), shaped dims (-1: any size), on the buffer's device, row-major without gaps
// (torch's is_contiguous()). The messages are those the Python layer raised before the core
// checked its arguments.
func (ts *Tensors) Arg(name string, d Desc, optional bool, dtypes []dlpack.DType, dims ...int64) dlpack.Tensor {
	t := ts.arg(name, d, optional, dtypes, dims)
	if t.Valid && ts.Err == nil && !contiguous(d) {
		ts.Err = Argf("%s: not contiguous; pass %s.contiguous()", name, name)
		return dlpack.Tensor{}
	}
	return t
}

// ArgStrided is Arg for a tensor whose strides the caller checks itself (d.Stride).
func (ts *Tensors) ArgStrided(name string, d Desc, optional bool, dtypes []dlpack.DType, dims ...int64) dlpack.Tensor {
	return ts.arg(name, d, optional, dtypes, dims)
}

func (ts *Tensors) arg(name string, d Desc, optional bool, dtypes []dlpack.DType, dims []int64) dlpack.Tensor {
	if ts.Err != nil {
		return dlpack.Tensor{}
	}
	if d.NDim == NoneDim {
		if !optional {
			ts.Err = Typef("%s must be a torch.Tensor, got NoneType", name)
		}
		return dlpack.Tensor{}
	}
	dt := dlpack.DType{}
	if d.DType >= 0 && d.DType < len(dlpackOf) {
		dt = dlpackOf[d.DType]
	}
	ok := dtypes == nil && dt != (dlpack.DType{})
	for _, want := range dtypes {
		ok = ok || dt == want
	}
	if !ok && dtypes == nil {
		ts.Err = Argf("%s: dtype %s, expected a real, integer or bool dtype (rows move as bytes)", name, dtypeName(d.DType))
		return dlpack.Tensor{}
	}
	if !ok {
		ts.Err = Argf("%s: dtype %s, expected %s", name, dtypeName(d.DType), dtypesText(dtypes))
		return dlpack.Tensor{}
	}
	ok = d.NDim == len(dims)
	for i := 0; ok && i < len(dims); i++ {
		ok = dims[i] < 0 || d.Size[i] == dims[i]
	}
	if !ok {
		ts.Err = Argf("%s: shape %s, expected %s", name, shapeText(d), dimsText(dims))
		return dlpack.Tensor{}
	}
	if d.Device != ts.Device {
		ts.Err = Argf("%s: on %s, expected %s (the buffer's device)", name, deviceName(d.Device), deviceName(ts.Device))
		return dlpack.Tensor{}
	}
	shape := ts.shape(d.Size[:d.NDim])
	numel := int64(1)
	for _, s := range shape {
		numel *= s
	}
	if d.Data == 0 && numel != 0 {
		ts.Err = Argf("%s: shape %s but no data (data_ptr() is 0)", name, shapeText(d))
		return dlpack.Tensor{}
	}
	return dlpack.Tensor{Valid: true, Data: dlpack.Pointer(d.Data), DeviceType: ts.DeviceType, DeviceID: ts.DeviceID,
		DType: dt, Shape: shape}
}

// contiguous is torch's is_contiguous(): strides of a dense row-major layout, except that a
// dimension of size 1 may have any stride and an empty tensor is contiguous.
func contiguous(d Desc) bool {
	for i := 0; i < d.NDim; i++ {
		if d.Size[i] == 0 {
			return true
		}
	}
	want := int64(1)
	for i := d.NDim - 1; i >= 0; i-- {
		if d.Size[i] != 1 && d.Stride[i] != want {
			return false
		}
		want *= d.Size[i]
	}
	return true
}

// Own is a tensor the pyep layer allocated contiguous, of dtype and dims, at data (0 = None;
// allowed only if optional, or empty: an empty tensor may have no address). Only its presence
// and its dims can be checked.
func (ts *Tensors) Own(name string, data uintptr, optional bool, dtype dlpack.DType, dims ...int64) dlpack.Tensor {
	if ts.Err != nil {
		return dlpack.Tensor{}
	}
	numel := int64(1)
	for _, d := range dims {
		if d < 0 {
			ts.Err = Argf("%s: shape %v has a negative size", name, slices.Clone(dims)) // dims itself stays on the caller's stack
			return dlpack.Tensor{}
		}
		numel *= d
	}
	if data == 0 && numel != 0 {
		if !optional {
			ts.Err = Argf("%s: expected a tensor, got None", name)
		}
		return dlpack.Tensor{}
	}
	return dlpack.Tensor{Valid: true, Data: dlpack.Pointer(data), DeviceType: ts.DeviceType, DeviceID: ts.DeviceID,
		DType: dtype, Shape: ts.shape(dims)}
}

// Views of a checked tensor's memory as Go slices, over all it spans (see dlpack.Tensor.Span);
// nil for an absent tensor.

func Bytes(t dlpack.Tensor) []byte       { return slice[byte](t, int64(t.DType.Size())) }
func Int32s(t dlpack.Tensor) []int32     { return slice[int32](t, 1) }
func Int64s(t dlpack.Tensor) []int64     { return slice[int64](t, 1) }
func Float32s(t dlpack.Tensor) []float32 { return slice[float32](t, 1) }
func Bools(t dlpack.Tensor) []bool       { return slice[bool](t, 1) }

func slice[T any](t dlpack.Tensor, per int64) []T {
	if !t.Valid {
		return nil
	}
	n := t.Span() * per
	if n == 0 || t.Data == nil {
		return []T{}
	}
	return unsafe.Slice((*T)(t.Data), n)
}

// RowBytes is the bytes of one row of a 2-D tensor.
func RowBytes(t dlpack.Tensor) int {
	if len(t.Shape) < 2 {
		return 0
	}
	return int(t.Shape[1]) * t.DType.Size()
}
