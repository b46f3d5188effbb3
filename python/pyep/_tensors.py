"""Views of the buffers the core hands out: a DLManagedTensor the core made, as a torch tensor of any dtype and shape.
(The caller's tensors cross into the core as plain integers: see _normal.py.)"""
import ctypes
from typing import Optional

import torch

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
