"""The bridge to the Go core: loads the gopy extension and turns its errors into Python ones.

Loading follows the hazards measured for gopy and cgo: the extension is opened with RTLD_LAZY
(go-nvml's NVML symbols resolve only when first called), gopy's gc callback (a full Go GC after
every Python GC, ~1 ms) is removed, and a forked child never calls into Go.
"""
import gc
import os
import sys


def _site_packages():
    """Where PyTorch's NVIDIA wheels (NVRTC among them) may be: the Go core reads PYEP_SITE_PACKAGES once, when
    the extension loads, so it is set before."""
    import site
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    try:
        import torch
        dirs.insert(0, os.path.dirname(os.path.dirname(torch.__file__)))
    except ImportError:
        pass
    return ":".join(d for d in dirs if d)


if not os.environ.get("PYEP_SITE_PACKAGES"):
    os.environ["PYEP_SITE_PACKAGES"] = _site_packages()

_saved_flags = sys.getdlopenflags()
sys.setdlopenflags(os.RTLD_LAZY | (_saved_flags & ~(os.RTLD_NOW | os.RTLD_GLOBAL)))
try:
    from ._gopy import pyep as _go  # noqa: E402
finally:
    sys.setdlopenflags(_saved_flags)

gc.callbacks[:] = [cb for cb in gc.callbacks if getattr(cb, "__name__", "") != "_gopy_gc_cb"]

_owner_pid = os.getpid()


class PyepError(RuntimeError):
    """An operation of the Go core failed (not a mistake in an argument)."""


class NotAvailableError(PyepError, NotImplementedError):
    """A DeepEP method that pyep has, with DeepEP's signature, but cannot run yet (internode normal mode, low-latency
    mode across nodes on cuda without NVSHMEM, MNNVL)."""


def not_available(method: str, what: str, hint: str = "") -> NotAvailableError:
    """The error of a method that pyep cannot run yet; hint (after "; ") says what setting of the user's is why."""
    return NotAvailableError(f"Buffer.{method}: {what} is not available in pyep yet" + (f"; {hint}" if hint else ""))


_FORKED = ("pyep cannot be used in a forked child process: the Go runtime does not survive fork; "
           "use the spawn start method or import pyep in the child")


def _refuse(*args):
    raise PyepError(_FORKED)


def _fast_calls():
    """The core's METH_FASTCALL functions by name (pyep/fastcall_cpython.go): the integers are read from Python's
    argument array, with no tuple, keyword list or format string, and the GIL released from C. Empty when the core
    has none, or PYEP_FASTCALL=0 (gopy's wrappers then, for comparison)."""
    if os.environ.get("PYEP_FASTCALL", "1") == "0":
        return {}
    defs = _go._core.pyep_FastCalls()
    if not defs:
        return {}
    import ctypes
    new = ctypes.pythonapi.PyCFunction_NewEx
    new.argtypes, new.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.py_object
    name_at = ctypes.c_char_p
    size = 4 * ctypes.sizeof(ctypes.c_void_p)  # PyMethodDef: name, function, flags (padded), doc
    calls = {}
    while True:
        name = name_at.from_address(defs).value
        if name is None:
            return calls
        calls[name.decode()] = new(defs, None, None)
        defs += size


class _Exports:
    """The exports that every normal-mode and low-latency call makes, bound to the core's fast functions (or gopy's C
    functions): a call costs no lookup and no Python wrapper. They raise RuntimeError with the core's message; `error`
    turns it into the Python exception."""

    calls = ("Layout", "DispatchQueued", "DispatchNotify", "DispatchRecv", "DispatchCached", "Combine",
             "PlanDispatch", "DispatchPlanned", "PlanCombine", "CombinePlanned", "LowLatencyDispatch",
             "LowLatencyCombine", "LowLatencyReceive", "LastEntryNs", "BufferLastLaunchNs")
    __slots__ = calls + ("fast",)  # fast: whether they are the core's fast functions

    def __init__(self):
        fast = _fast_calls()
        self.fast = bool(fast)
        for name in self.calls:
            setattr(self, name, fast.get(name) or getattr(_go._core, "pyep_" + name))


go = _Exports()


def _forked_child():
    global _owner_pid
    _owner_pid = -1
    for name in _Exports.calls:
        setattr(go, name, _refuse)


os.register_at_fork(after_in_child=_forked_child)


def error(e):
    """The Python exception of a core error: "ValueError: ", "TypeError: " and "NotAvailableError: " ones become
    those, any other a PyepError."""
    msg = str(e)
    for kind in (ValueError, TypeError, NotAvailableError):
        prefix = kind.__name__ + ": "
        if msg.startswith(prefix):
            return kind(msg[len(prefix):])
    return PyepError(msg)


def call(name, *args):
    """Calls the Go export `name`, raising `error`'s exception. A forked child raises instead of entering the
    parent's Go runtime."""
    if _owner_pid != os.getpid():
        raise PyepError(_FORKED)
    try:
        return getattr(_go, name)(*args)
    except RuntimeError as e:
        raise error(e) from None


def usable():
    """Whether this process may call into Go (False in a forked child)."""
    return _owner_pid == os.getpid()
