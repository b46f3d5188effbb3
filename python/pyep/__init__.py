"""pyep: expert-parallel communication for Mixture-of-Experts models, a drop-in for DeepEP's Buffer
with its core in Go. `import pyep as deep_ep` works in code written for DeepEP V1."""
from ._core import NotAvailableError, PyepError
from .buffer import Buffer, topk_idx_t
from .config import Config
from .utils import EventHandle, EventOverlap
from ._core import call as _call

__version__ = _call("Version")

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "NotAvailableError", "PyepError", "topk_idx_t", "__version__"]
