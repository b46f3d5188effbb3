"""The Go core's side of one Buffer, with the method names of DeepEP's C++ runtime (`deep_ep_cpp.Buffer`)."""
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _core
from ._tensors import _DL_UINT8, _bytes_view, _element_size, _typed_view


def _cuda_backend() -> str:
    """The cuda backend on PyTorch's current device (the Go core takes the ordinal)."""
    return f"cuda:{torch.cuda.current_device()}"


def _backend_for(group: Optional[dist.ProcessGroup]) -> str:
    """cuda (as "cuda:<current device>") for NCCL groups on a machine with GPUs, cpu (shared
    memory) otherwise; PYEP_BACKEND=cpu|cuda overrides."""
    forced = os.environ.get("PYEP_BACKEND")
    if forced:
        return _cuda_backend() if forced == "cuda" else forced
    if group is None:
        return _cuda_backend() if torch.cuda.is_available() else "cpu"
    name = str(dist.get_backend(group)).lower()
    return _cuda_backend() if "nccl" in name and torch.cuda.is_available() else "cpu"


class _Runtime:
    """The core's side of one Buffer, with the method names of DeepEP's `deep_ep_cpp.Buffer`."""

    def __init__(self, backend: str, rank: int, num_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool, explicitly_destroy: bool, enable_shrink: bool, use_fabric: bool,
                 allow_nvlink_for_low_latency_mode: bool = True) -> None:
        if backend == "cuda":
            backend = _cuda_backend()
        # "cpu" or "cuda"; the device is get_local_device_id().
        self.backend = backend.partition(":")[0]
        # The core reads PYEP_RANKS_PER_NODE here (nodes of that many ranks instead of DeepEP's 8).
        self.id = _core.call("NewBuffer", backend, rank, num_ranks, num_nvl_bytes, num_rdma_bytes,
                             low_latency_mode, explicitly_destroy, enable_shrink, use_fabric,
                             allow_nvlink_for_low_latency_mode)
        # ranks_per_node: PYEP_RANKS_PER_NODE's node size as the core read it, 0 when unset.
        (self._device_id, self.rank, self.num_ranks, self._rdma_rank, self._num_rdma_ranks,
         self._nvl_rank, self._num_nvl_ranks, self.ranks_per_node) = map(int, _core.call("BufferInfo", self.id).split())
        self.destroyed = False

    def get_local_device_id(self) -> int:
        return self._device_id

    def get_num_rdma_ranks(self) -> int:
        return self._num_rdma_ranks

    def get_rdma_rank(self) -> int:
        return self._rdma_rank

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self._nvl_rank if global_ else 0

    def get_local_ipc_handle(self) -> bytes:
        return bytes.fromhex(_core.call("BufferLocalIPCHandle", self.id))

    def get_local_nvshmem_unique_id(self) -> bytes:
        return bytes.fromhex(_core.call("BufferLocalNVSHMEMUniqueID", self.id))

    def sync(self, device_ids: List[int], all_gathered_handles: List[Optional[bytes]],
             root_unique_id_opt: Optional[bytes] = None) -> None:
        for name, values in (("device_ids", device_ids), ("ipc_handles", all_gathered_handles)):
            if not isinstance(values, (list, tuple)):
                raise TypeError(f"{name} must be a list, got {type(values).__name__}")
        handles = []
        for i, h in enumerate(all_gathered_handles):
            if h is not None and not isinstance(h, (bytes, bytearray)):
                raise TypeError(f"ipc_handles[{i}] must be bytes or None, got {type(h).__name__}")
            handles.append(bytes(h).hex() if h else "-")
        _core.call("BufferSync", self.id, " ".join(str(int(d)) for d in device_ids), " ".join(handles),
                   bytes(root_unique_id_opt).hex() if root_unique_id_opt else "")

    def is_available(self) -> bool:
        return not self.destroyed and _core.call("BufferIsAvailable", self.id)

    def destroy(self) -> None:
        if not self.destroyed:
            self.destroyed = True
            if _core.usable():
                _core.call("BufferDestroy", self.id)

    def get_local_buffer_tensor(self, dtype: torch.dtype, offset: int = 0, use_rdma_buffer: bool = False,
                                nvl_rank: int = -1) -> torch.Tensor:
        if offset % _element_size(dtype):
            raise ValueError(f"offset = {offset}: expected a multiple of the {dtype} element size, "
                             f"{_element_size(dtype)} bytes")
        raw = _bytes_view(_core.call("BufferView", self.id, nvl_rank, use_rdma_buffer, *_DL_UINT8, offset))
        return _typed_view(raw, dtype)
