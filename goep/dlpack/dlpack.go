// Package dlpack makes the DLPack tensors that pyep hands back to Python (views over its
// buffers) and reads them (Parse); its element types and checked views (Tensor) are the core's.
// The caller's tensors cross as plain integers instead (goep.Desc). The structs follow the
// DLPack ABI (v0.8, the legacy unversioned DLManagedTensor that every framework still accepts).
package dlpack

/*
#include <stdint.h>
#include <stdlib.h>

typedef struct { int32_t device_type; int32_t device_id; } pyep_DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } pyep_DLDataType;
typedef struct {
	void* data;
	pyep_DLDevice device;
	int32_t ndim;
	pyep_DLDataType dtype;
	int64_t* shape;
	int64_t* strides;
	uint64_t byte_offset;
} pyep_DLTensor;
typedef struct pyep_DLManagedTensor {
	pyep_DLTensor dl_tensor;
	void* manager_ctx;
	void (*deleter)(struct pyep_DLManagedTensor*);
} pyep_DLManagedTensor;

// The tensor, its one shape entry and the deleter live in one malloc block: the consumer
// (torch) calls the deleter from any thread, after the Go call returned, so it must not
// re-enter Go.
static void pyep_dl_free(pyep_DLManagedTensor* self) { free(self); }

static pyep_DLManagedTensor* pyep_dl_new(void* data, int32_t dev_type, int32_t dev_id,
		uint8_t code, uint8_t bits, int64_t numel) {
	pyep_DLManagedTensor* t = (pyep_DLManagedTensor*)calloc(1, sizeof(pyep_DLManagedTensor) + sizeof(int64_t));
	if (t == NULL) return NULL;
	int64_t* shape = (int64_t*)(t + 1);
	shape[0] = numel;
	t->dl_tensor.data = data;
	t->dl_tensor.device.device_type = dev_type;
	t->dl_tensor.device.device_id = dev_id;
	t->dl_tensor.ndim = 1;
	t->dl_tensor.dtype.code = code;
	t->dl_tensor.dtype.bits = bits;
	t->dl_tensor.dtype.lanes = 1;
	t->dl_tensor.shape = shape;
	t->deleter = pyep_dl_free;
	return t;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"
)

// Device types of DLPack.
const (
	CPU  = 1
	CUDA = 2
)

// Type codes of DLPack.
const (
	Int          = 0
	UInt         = 1
	Float        = 2
	Bfloat       = 4
	Bool         = 6
	Float8E4M3FN = 10
	Float8E5M2   = 12
)

// DType is a DLPack element type.
type DType struct {
	Code, Bits uint8
}

// Well-known element types.
var (
	BF16    = DType{Bfloat, 16}
	F16     = DType{Float, 16}
	F32     = DType{Float, 32}
	I32     = DType{Int, 32}
	I64     = DType{Int, 64}
	BoolT   = DType{Bool, 8}
	FP8E4M3 = DType{Float8E4M3FN, 8}
	FP8E5M2 = DType{Float8E5M2, 8}
)

// Size is the element size in bytes.
func (d DType) Size() int { return int(d.Bits) / 8 }

func (d DType) String() string {
	switch d {
	case BF16:
		return "bfloat16"
	case F16:
		return "float16"
	case F32:
		return "float32"
	case I32:
		return "int32"
	case I64:
		return "int64"
	case BoolT:
		return "bool"
	case FP8E4M3:
		return "float8_e4m3fn"
	case FP8E5M2:
		return "float8_e5m2"
	}
	return fmt.Sprintf("dlpack(code=%d, bits=%d)", d.Code, d.Bits)
}

// Tensor is a read view of a DLPack tensor: dense and row-major, unless ParseStrided made it.
type Tensor struct {
	Valid      bool // false for an absent tensor (Data alone cannot tell: an empty tensor may have none)
	Data       unsafe.Pointer
	DeviceType int
	DeviceID   int
	DType      DType
	Shape      []int64
	// Strides in elements, only where they are not the dense row-major ones (nil: dense).
	Strides []int64
}

// Numel is the number of elements.
func (t Tensor) Numel() int64 {
	n := int64(1)
	for _, s := range t.Shape {
		n *= s
	}
	return n
}

// Span is the number of elements from Data to the tensor's last element, inclusive: what a
// strided tensor's memory spans (Numel for a dense one, 0 for an empty one).
func (t Tensor) Span() int64 {
	if t.Strides == nil {
		return t.Numel()
	}
	span := int64(1)
	for i, s := range t.Shape {
		if s == 0 {
			return 0
		}
		span += (s - 1) * t.Strides[i]
	}
	return span
}

// Parse reads the DLManagedTensor at addr (the pointer inside a "dltensor" capsule) and checks
// that it is dense and row-major. The tensor stays owned by the capsule.
func Parse(addr uintptr) (Tensor, error) {
	t, err := ParseStrided(addr)
	if err == nil && t.Strides != nil {
		return Tensor{}, fmt.Errorf("not contiguous (shape %v, strides %v): pass .contiguous()", t.Shape, t.Strides)
	}
	return t, err
}

// ParseStrided is Parse for a tensor whose strides the caller handles: the result's Strides are
// set when they are not the dense row-major ones. Negative strides are refused.
func ParseStrided(addr uintptr) (Tensor, error) {
	if addr == 0 {
		return Tensor{}, errors.New("null DLPack tensor")
	}
	m := (*C.pyep_DLManagedTensor)(Pointer(addr))
	dl := &m.dl_tensor
	ndim := int(dl.ndim)
	if ndim < 0 || ndim > 8 {
		return Tensor{}, fmt.Errorf("DLPack tensor with %d dimensions", ndim)
	}
	t := Tensor{
		Valid:      true,
		Data:       unsafe.Add(dl.data, uintptr(dl.byte_offset)),
		DeviceType: int(dl.device.device_type),
		DeviceID:   int(dl.device.device_id),
		DType:      DType{uint8(dl.dtype.code), uint8(dl.dtype.bits)},
		Shape:      make([]int64, ndim),
	}
	if lanes := int(dl.dtype.lanes); lanes != 1 {
		// A packed type (float4_e2m1fn_x2 is 2 lanes of 4 bits) is one element of whole bytes: rows
		// of it only move.
		if bits := lanes * int(dl.dtype.bits); lanes > 1 && bits%8 == 0 && bits <= 255 {
			t.DType.Bits = uint8(bits)
		} else {
			return Tensor{}, fmt.Errorf("vector element type with %d lanes of %d bits", lanes, dl.dtype.bits)
		}
	}
	if t.DType.Bits == 0 || t.DType.Bits%8 != 0 {
		return Tensor{}, fmt.Errorf("element type of %d bits (code %d): not whole bytes", t.DType.Bits, t.DType.Code)
	}
	if ndim > 0 {
		shape := unsafe.Slice((*int64)(unsafe.Pointer(dl.shape)), ndim)
		copy(t.Shape, shape)
	}
	if dl.strides != nil && ndim > 0 {
		strides := unsafe.Slice((*int64)(unsafe.Pointer(dl.strides)), ndim)
		want, dense := int64(1), true
		for i := ndim - 1; i >= 0; i-- {
			if strides[i] < 0 {
				return Tensor{}, fmt.Errorf("negative strides %v (shape %v)", strides, t.Shape)
			}
			// A dimension of size 1 may carry any stride.
			dense = dense && (t.Shape[i] == 1 || strides[i] == want)
			want *= t.Shape[i]
		}
		if !dense && want != 0 {
			t.Strides = append([]int64(nil), strides...)
		}
	}
	return t, nil
}

// NewView makes a one-dimensional DLManagedTensor of numel elements of dtype at data, for a
// consumer to wrap (torch.from_dlpack); the consumer's call of its deleter frees it. It does
// not own data: the memory must outlive the view.
func NewView(data unsafe.Pointer, deviceType, deviceID int, dtype DType, numel int64) (uintptr, error) {
	m := C.pyep_dl_new(data, C.int32_t(deviceType), C.int32_t(deviceID), C.uint8_t(dtype.Code), C.uint8_t(dtype.Bits), C.int64_t(numel))
	if m == nil {
		return 0, errors.New("out of memory for a DLPack view")
	}
	return uintptr(unsafe.Pointer(m)), nil
}

// FreeView releases a view that never reached a consumer.
func FreeView(addr uintptr) {
	if addr != 0 {
		C.free(Pointer(addr))
	}
}

// Pointer turns an address that Python passed as an integer back into a pointer. The memory
// is not Go's (a tensor's, a mapping's), so the garbage collector has nothing to track.
func Pointer(addr uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}
