"""Tensors across the core's boundary. The caller's go in as plain integers: a tensor as the eight integers of the
core's goep.Desc (data_ptr, dtype, device, dimensions, two sizes, two strides), which the core checks. The core's
come out as views: a DLManagedTensor the core made, as a torch tensor of any dtype and shape."""
import ctypes
from typing import Optional

import torch

from . import _core

# A torch function mode (torch.set_default_device installs one; DeepEP's tests set it) routes every torch call and
# tensor attribute through Python: it trebles a call's host time (a layout's Python part measured 2.2 -> 15.2 µs).
# The hot calls run without modes, as DeepEP's C++ does: they re-enter themselves under without_modes() when
# modes_on(). Every tensor they make names its device, so a default device changes nothing they return.
modes_on = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)
without_modes = getattr(torch._C, "DisableTorchFunction", None)

# The capsule name must outlive every capsule made with it, hence a module constant.
_DLTENSOR = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# DLPack (type code, bits) of a byte, the element of every view the core hands out.
_DL_UINT8 = (1, 8)


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


class _Codes(dict):
    """torch objects to the core's integer codes, each computed on first sight."""

    def __init__(self, code) -> None:
        super().__init__()
        self.code = code

    def __missing__(self, key):
        value = self[key] = self.code(key)
        return value


def _torch_names():
    dtypes, devices = _core.call("TorchNames").split(";")
    dtype_index = {name: i for i, name in enumerate(dtypes.split())}
    device_index = {name: i for i, name in enumerate(devices.split())}
    by_code = {}
    for d in vars(torch).values():
        if isinstance(d, torch.dtype) and str(d)[6:] in dtype_index:
            by_code[dtype_index[str(d)[6:]]] = d
    return dtype_index, device_index, by_code


_DTYPE_INDEX, _DEVICE_INDEX, _DTYPE_OF = _torch_names()
_ITEMSIZE = {code: d.itemsize for code, d in _DTYPE_OF.items()}
_INT32, _BOOL = _DTYPE_INDEX["int32"], _DTYPE_INDEX["bool"]
# A dtype's index in the core's list (-1: one it does not know), and a device's code (goep.DeviceCode).
_DT = _Codes(lambda d: _DTYPE_INDEX.get(str(d)[6:], -1))
_DV = _Codes(lambda d: _DEVICE_INDEX.get(d.type, len(_DEVICE_INDEX)) << 16 | (0 if d.index is None else d.index + 1))
_NONE = (0, -1, 0, -1, 0, 0, 0, 0)


def _desc(name: str, t: object) -> tuple:
    """A tensor, or None, as the eight integers of the core's goep.Desc; the core checks them."""
    if t is None:
        return _NONE
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape, stride = t.shape, t.stride()
    # A Desc holds two sizes: no argument of pyep has more dimensions, and the core names the shape.
    s, st = tuple(shape[:2]) + (0, 0), tuple(stride[:2]) + (0, 0)
    return t.data_ptr(), _DT[t.dtype], _DV[t.device], len(shape), s[0], s[1], st[0], st[1]


def _desc2(name: str, t: object) -> tuple:
    """_desc for an argument that should have two dimensions: every call reads several, so the usual case is the
    quick one."""
    if t is None:
        return _NONE
    try:
        s0, s1 = t.shape
        t0, t1 = t.stride()
        return t.data_ptr(), _DT[t.dtype], _DV[t.device], 2, s0, s1, t0, t1
    except (AttributeError, TypeError, ValueError):
        return _desc(name, t)


def _desc1(name: str, t: object) -> tuple:
    """_desc for an argument that should have one dimension."""
    if t is None:
        return _NONE
    try:
        s0, = t.shape
        t0, = t.stride()
        return t.data_ptr(), _DT[t.dtype], _DV[t.device], 1, s0, 0, t0, 0
    except (AttributeError, TypeError, ValueError):
        return _desc(name, t)


def _int(name: str, value: object, low: int) -> int:
    """An int argument (bools too, as DeepEP's binding takes them) that torch needs before the core checks it."""
    if not isinstance(value, int):
        raise ValueError(f"{name} = {value!r}: expected an int >= {low}")
    return int(value)


def _raise_int(e: TypeError, **ints) -> None:
    """gopy refuses an argument that is not an int with a TypeError that names none: name the argument."""
    for name, (value, low) in ints.items():
        _int(name, value, low)
    raise e
