package goep

import (
	"unsafe"

	"github.com/pyep/pyep/goep/dlpack"
)

// Tensors turns the addresses of one call's tensors into checked views. The first mistake is
// kept (Err) and names the argument; later calls are no-ops, so a caller checks once.
//
// Two kinds of address cross: a caller's tensor comes as the address of its DLPack tensor
// (Get), which says its device, dtype and shape; a tensor the pyep layer allocated itself (a
// call's outputs, a handle's tensors) comes as its bare data address (Own), in the shape the
// core derives from the rest of the call. A DLPack capsule costs about a microsecond of Python,
// and a dispatch has ten such tensors.
type Tensors struct {
	DeviceType int // every tensor must live here (dlpack.CPU or dlpack.CUDA)
	DeviceID   int // the device ordinal of the tensors of Own
	Err        error
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
			ts.Err = Argf("%s: shape %v has a negative size", name, dims)
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
		DType: dtype, Shape: dims}
}

// Get parses the tensor at addr (0 = None; allowed only if optional), which must be dense and
// row-major, and checks its dtype (any of dtypes; nil: any) and shape (-1 matches any size).
func (ts *Tensors) Get(name string, addr uintptr, optional bool, dtypes []dlpack.DType, dims ...int64) dlpack.Tensor {
	return ts.get(name, addr, optional, false, dtypes, dims)
}

// GetStrided is Get for a tensor whose strides the caller checks: its Strides are set where they
// are not the dense row-major ones.
func (ts *Tensors) GetStrided(name string, addr uintptr, optional bool, dtypes []dlpack.DType, dims ...int64) dlpack.Tensor {
	return ts.get(name, addr, optional, true, dtypes, dims)
}

func (ts *Tensors) get(name string, addr uintptr, optional, strided bool, dtypes []dlpack.DType, dims []int64) dlpack.Tensor {
	if ts.Err != nil {
		return dlpack.Tensor{}
	}
	if addr == 0 {
		if !optional {
			ts.Err = Argf("%s: expected a tensor, got None", name)
		}
		return dlpack.Tensor{}
	}
	parse := dlpack.Parse
	if strided {
		parse = dlpack.ParseStrided
	}
	t, err := parse(addr)
	if err != nil {
		ts.Err = Argf("%s: %v", name, err)
		return dlpack.Tensor{}
	}
	if t.DeviceType != ts.DeviceType {
		ts.Err = Argf("%s: tensor on device type %d, expected %d (every tensor on this buffer's device)", name, t.DeviceType, ts.DeviceType)
		return dlpack.Tensor{}
	}
	ok := dtypes == nil
	for _, d := range dtypes {
		ok = ok || t.DType == d
	}
	if !ok {
		ts.Err = Argf("%s: dtype %v, expected %v", name, t.DType, dtypes)
		return dlpack.Tensor{}
	}
	if len(t.Shape) != len(dims) {
		ts.Err = Argf("%s: shape %v, expected %d dimensions %v", name, t.Shape, len(dims), dims)
		return dlpack.Tensor{}
	}
	for i, d := range dims {
		if d >= 0 && t.Shape[i] != d {
			ts.Err = Argf("%s: shape %v, expected %v (-1: any)", name, t.Shape, dims)
			return dlpack.Tensor{}
		}
	}
	return t
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
