"""Tensors across the Go core's boundary: DLPack capsules of the caller's tensors, argument checks, the packed
allocation of a call's small outputs, and views of the buffers the core hands out."""
import ctypes
import functools
from typing import Optional, Tuple

import torch

# The capsule name must outlive every capsule made with it, hence a module constant.
_DLTENSOR = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# DLPack (type code, bits) of a byte, the element of every view the core hands out.
_DL_UINT8 = (1, 8)


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLPack:
    """Hands tensors to the core as DLPack addresses; keeps their capsules alive until the call returns."""

    __slots__ = ("capsules",)

    def __init__(self) -> None:
        self.capsules = []

    def __call__(self, tensor: Optional[torch.Tensor]) -> int:
        if tensor is None:
            return 0
        capsule = torch.utils.dlpack.to_dlpack(tensor)
        self.capsules.append(capsule)
        return _capsule_pointer(capsule, _DLTENSOR)


def _check_tensor(name: str, t: object, dtypes: Optional[Tuple[torch.dtype, ...]], dims: Tuple[Optional[int], ...],
                  device: torch.device, hint: str = "", contiguous: bool = True) -> torch.Tensor:
    """Raises TypeError/ValueError naming `name` unless t is a tensor of one of `dtypes` (None: any), shaped `dims`
    (None: any size), on `device`, and contiguous if `contiguous`. `hint` follows the message of a wrong dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected " + " or ".join(map(str, dtypes)) + hint)
    shape = t.shape
    bad = len(shape) != len(dims)
    if not bad:
        for s, d in zip(shape, dims):  # a loop, not any(): this runs on every call
            if d is not None and s != d:
                bad = True
                break
    if bad:
        expected = "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"
        raise ValueError(f"{name}: shape {list(shape)}, expected {expected}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (the buffer's device)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous; pass {name}.contiguous()")
    return t


# DeepEP's FP8 scales: float32, or int32 (UE8M0, four packed in an int).
_SCALE_DTYPES = (torch.float32, torch.int32)


def _check_scales(name: str, t: object, num_tokens: int, device: torch.device) -> torch.Tensor:
    """_check_tensor for FP8 scales [num_tokens, *], which may be row-major or column-major, as DeepEP reads them
    by stride (DeepGEMM makes them column-major, strides (1, num_tokens), the larger stride possibly padded)."""
    _check_tensor(name, t, _SCALE_DTYPES, (num_tokens, None), device, contiguous=False)
    T, S = t.shape
    st, ss = t.stride()
    # The stride of a dimension of size 1 does not matter (the core reads it so too).
    st, ss = (1 if T == 1 else st), (1 if S == 1 else ss)
    if T and S and not (ss == 1 and st >= S or st == 1 and ss >= T):
        raise ValueError(f"{name}: strides {tuple(t.stride())} for shape {list(t.shape)}: expected row-major ({S}, 1) or "
                         f"column-major (1, {T}) scales (the larger stride may be padded)")
    return t


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}: expected an int >= {low}")
    return value


def _addr(t: Optional[torch.Tensor]) -> int:
    """The data address that the core takes for a tensor pyep allocated (0 for None)."""
    return 0 if t is None else t.data_ptr()


@functools.lru_cache(maxsize=256)
def _packing(specs: tuple) -> Tuple[Tuple[int, ...], int]:
    """The byte offsets of tensors ((dtype, shape), ...) packed into one allocation, each on a 256-byte boundary,
    and the allocation's bytes."""
    offsets, end = [], 0
    for dtype, shape in specs:
        offsets.append(end)
        n = _element_size(dtype)
        for s in shape:
            n *= s
        end += (n + 255) // 256 * 256
    return tuple(offsets), max(end, 256)


class _Packed:
    """A call's small output tensors in one allocation: one torch.empty (~3 µs each) instead of one apiece. The core
    takes their addresses (`addr`); Python makes their views (`view`) once it has returned."""

    __slots__ = ("block", "base", "specs", "offsets", "typed")

    def __init__(self, specs: tuple, device: torch.device) -> None:
        self.specs = specs
        self.offsets, size = _packing(specs)
        self.block = torch.empty(size, dtype=torch.uint8, device=device)
        self.base = self.block.data_ptr()
        self.typed = {}

    def addr(self, i: int) -> int:
        return self.base + self.offsets[i]

    def view(self, i: int, rows: Optional[int] = None) -> torch.Tensor:
        """Tensor i (one or two dimensions), or its first `rows` rows."""
        dtype, shape = self.specs[i]
        if rows is not None:
            shape = (rows,) + shape[1:]
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.typed[dtype] = self.block.view(dtype)
        stride = (shape[1], 1) if len(shape) == 2 else (1,)
        return typed.as_strided(shape, stride, self.offsets[i] // typed.element_size())


def _bytes_view(addr: int) -> torch.Tensor:
    """Wraps a DLManagedTensor made by the core; torch frees it with the tensor."""
    return torch.utils.dlpack.from_dlpack(_capsule_new(addr, _DLTENSOR, None))


def _element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return dtype.itemsize


def _typed_view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterprets a byte view as whole elements of dtype."""
    elem = _element_size(dtype)
    return raw[: raw.numel() // elem * elem].view(dtype)


def _shaped(tensor: torch.Tensor, size: Optional[torch.Size]) -> torch.Tensor:
    if size is None:
        return tensor
    size = torch.Size(size)
    if size.numel() > tensor.numel():
        raise ValueError(f"size = {tuple(size)}: needs {size.numel()} elements, the buffer holds {tensor.numel()} "
                         f"of {tensor.dtype} from this offset")
    return tensor[: size.numel()].view(size)
