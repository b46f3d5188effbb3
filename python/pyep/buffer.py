"""Buffer: DeepEP V1's expert-parallel communication buffer, over pyep's Go core (normal mode: _normal.py)."""
import atexit
import ctypes
import os
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _core
from ._normal import NormalMode, topk_idx_t  # noqa: F401 (topk_idx_t is pyep's API)
from .config import Config
from .tuning import load_tuned
from .utils import EventHandle, EventOverlap

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
                 low_latency_mode: bool, explicitly_destroy: bool, enable_shrink: bool, use_fabric: bool) -> None:
        if backend == "cuda":
            backend = _cuda_backend()
        # "cpu" or "cuda"; the device is get_local_device_id().
        self.backend = backend.partition(":")[0]
        self.id = _core.call("NewBuffer", backend, rank, num_ranks, num_nvl_bytes, num_rdma_bytes,
                             low_latency_mode, explicitly_destroy, enable_shrink, use_fabric)
        (self._device_id, self.rank, self.num_ranks, self._rdma_rank, self._num_rdma_ranks,
         self._nvl_rank, self._num_nvl_ranks) = map(int, _core.call("BufferInfo", self.id).split())
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


# Buffers not yet released, destroyed at interpreter exit so no shared memory outlives it.
_live: "weakref.WeakSet[Buffer]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    # In creation order, the same on every rank: on cuda, destroying a buffer waits until every peer has released
    # its mapping, which a peer does when it destroys the same buffer, so ranks must go through them alike (a
    # WeakSet's order differs between processes, and two ranks each waiting on another buffer would both time out).
    for buffer in sorted(_live, key=lambda b: b.runtime.id if getattr(b, "runtime", None) is not None else -1):
        buffer._release()


class Buffer(NormalMode):
    """
    The expert-parallel (EP) communication buffers of a Mixture-of-Experts model, DeepEP V1's API:
        - normal (high-throughput) intranode dispatch and combine over NVLink (cuda) or shared memory (cpu);
        - an RDMA buffer for internode and low-latency modes.

    The backend follows the group: a gloo group (CPU tensors) selects the cpu backend, an NCCL group on a
    machine with GPUs the cuda backend; the environment variable PYEP_BACKEND=cpu|cuda overrides.

    Attributes:
        num_sms: the SMs (two per channel) that normal-mode kernels use; class-wide, see `set_num_sms`.
        rank: the local rank number.
        group_size: the number of ranks in the group.
        group: the communication group.
        num_nvl_bytes: the buffer size for intranode (NVLink or shared-memory) communication.
        num_rdma_bytes: the buffer size for internode (and low-latency) RDMA communication.
        low_latency_mode: whether low-latency mode is enabled.
        runtime: the Go core's side, with the method names of DeepEP's C++ runtime.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[object] = None) -> None:
        """
        Allocates this rank's buffers and connects them with every peer's (a collective call: every rank of
        the group must make it).

        Arguments:
            group: the communication group (a torch.distributed ProcessGroup), or None with `comm`.
            num_nvl_bytes: bytes of the intranode buffer, a multiple of 128 (see `Config.get_nvl_buffer_size_hint`).
            num_rdma_bytes: bytes of the RDMA buffer, a multiple of 128; needs more than 8 ranks or low-latency mode.
            low_latency_mode: whether to enable low-latency mode.
            num_qps_per_rank: RDMA queue pairs per rank (NVSHMEM/IBGDA), positive.
            allow_nvlink_for_low_latency_mode: whether low-latency traffic may use NVLink.
            allow_mnnvl: whether multi-node NVLink may be used.
            use_fabric: on cuda, whether the intranode buffer is cuMem memory shared through a fabric handle (where the
                GPU, the driver and an IMEX channel allow) or else, saying why once on stderr, through a POSIX file
                descriptor passed over a Unix socket, instead of CUDA IPC; PYEP_MEM_HANDLE=auto|fabric|fd, read when the
                buffer is made, forces the kind. Either way within one node. The cpu backend ignores it.
            explicitly_destroy: if set, `destroy()` must be called to release resources; otherwise they are released
                when the buffer is collected (and at interpreter exit).
            enable_shrink: whether to allow shrinking the group after a rank fails (low-latency mode).
            comm: an mpi4py communicator to use instead of `group` for the setup exchanges.
        """
        if group is None and comm is None:
            raise ValueError("group: expected a torch.distributed ProcessGroup (or pass comm=, an mpi4py communicator)")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                            ("num_qps_per_rank", num_qps_per_rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        self.group = group
        self.comm = comm
        if group is not None:
            self.rank, self.group_size = group.rank(), group.size()
        else:
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._comm_stream = None
        self.runtime = _Runtime(_backend_for(group), self.rank, self.group_size, num_nvl_bytes, num_rdma_bytes,
                                low_latency_mode, explicitly_destroy, enable_shrink, use_fabric)
        _live.add(self)
        try:
            device_ids = self._all_gather(self.runtime.get_local_device_id())
            ipc_handles = self._all_gather(self.runtime.get_local_ipc_handle() if num_nvl_bytes > 0 else None)
            root_unique_id = None
            if self.runtime.get_num_rdma_ranks() > 1 or low_latency_mode:
                if num_qps_per_rank <= 0:
                    raise ValueError(f"num_qps_per_rank = {num_qps_per_rank}: expected a positive number")
                is_root = self.rank == 0 if low_latency_mode else self.runtime.get_rdma_rank() == 0
                unique_ids = self._all_gather(self.runtime.get_local_nvshmem_unique_id() if is_root else None)
                root_unique_id = unique_ids[0 if low_latency_mode else self.runtime.get_root_rdma_rank(True)]
            failure = None
            try:
                self.runtime.sync(device_ids, ipc_handles, root_unique_id)
            except (ValueError, _core.PyepError) as e:
                failure = e
            # Every rank learns whether every other one synced: a rank that failed must not leave the others
            # using a half-connected group, and no rank may release its memory before all peers mapped it.
            failures = self._all_gather(None if failure is None else f"{type(failure).__name__}: {failure}")
            if failure is not None:
                raise failure
            failed = [(r, f) for r, f in enumerate(failures) if f is not None]
            if failed:
                raise _core.PyepError("Buffer: sync failed on " + "; ".join(f"rank {r} ({f})" for r, f in failed))
        except BaseException:
            self._release()
            raise
        assert self.runtime.is_available()
        self._normal_init()

    def _all_gather(self, obj: object) -> list:
        if self.group is None:
            return list(self.comm.allgather(obj))
        gathered = [None] * self.group_size
        dist.all_gather_object(gathered, obj, self.group)
        return gathered

    def _release(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.destroy()
        _live.discard(self)

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is None or runtime.destroyed:
            return
        if self.explicitly_destroy:
            print("WARNING: pyep Buffer was collected without destroy() although explicitly_destroy=True; "
                  "releasing it now", flush=True)
        self._release()

    def is_available(self) -> bool:
        """Whether the buffer is synced with its peers and not destroyed."""
        return self.runtime.is_available()

    def destroy(self) -> None:
        """
        Releases the buffer's memory and its mappings of the peers' buffers; needs `explicitly_destroy=True`.
        Calling it again does nothing. Every later operation on the buffer raises.
        """
        if not self.explicitly_destroy:
            raise RuntimeError("destroy(): the buffer was made without explicitly_destroy=True; it is released "
                               "when collected")
        self._release()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """
        Sets the number of SMs that normal-mode kernels use (class-wide).

        Arguments:
            new_num_sms: the new number, positive and even (two SMs a channel).
        """
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"new_num_sms = {new_num_sms!r}: expected a positive even int (two SMs a channel)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """
        Captures an event on the current stream (`torch.cuda.current_stream()`; on a machine without CUDA, an
        already complete event).

        Returns:
            event: the captured event.
        """
        return EventOverlap(EventHandle(torch.device("cuda", torch.cuda.current_device())
                                        if torch.cuda.is_available() else None))

    def get_comm_stream(self) -> torch.cuda.Stream:
        """
        Gets pyep's communication stream (cuda backend): the stream its kernels run on, created by pyep
        (non-blocking, highest priority) and shared by the Buffers of this process on this GPU.

        Returns:
            stream: a `torch.cuda.ExternalStream` (a `torch.cuda.Stream`) wrapping it.
        """
        if self._comm_stream is None:
            raw = _core.call("BufferCommStream", self.runtime.id)
            self._comm_stream = torch.cuda.ExternalStream(raw, device=torch.device("cuda", self.runtime.get_local_device_id()))
        return self._comm_stream

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """
        Gets the recommended dispatch config for `num_ranks` ranks with `Buffer.num_sms` SMs: this machine's tuned
        one when `python -m pyep.bench --tune` wrote a tuning file, DeepEP V1's table otherwise.

        Arguments:
            num_ranks: the number of ranks.

        Returns:
            config: the recommended config.
        """
        return load_tuned("dispatch", num_ranks, Buffer.num_sms) or Config._recommended("dispatch", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """
        Gets the recommended combine config for `num_ranks` ranks with `Buffer.num_sms` SMs: this machine's tuned
        one when `python -m pyep.bench --tune` wrote a tuning file, DeepEP V1's table otherwise.

        Arguments:
            num_ranks: the number of ranks.

        Returns:
            config: the recommended config.
        """
        return load_tuned("combine", num_ranks, Buffer.num_sms) or Config._recommended("combine", num_ranks, Buffer.num_sms)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """
        Gets this rank's raw buffer (or a slice of it) as a tensor that views the buffer's memory.

        Arguments:
            dtype: the element type of the tensor.
            size: the shape of the slice (`torch.Size`); None for the whole buffer from `offset` on.
            offset: where the view starts, in bytes (as DeepEP's runtime counts it); a multiple of the element size.
            use_rdma_buffer: whether to view the RDMA buffer instead of the NVLink one.

        Returns:
            tensor: a 1-D tensor of `dtype` (or shaped `size`) on the buffer's device.
        """
        return _shaped(self.runtime.get_local_buffer_tensor(dtype, offset, use_rdma_buffer), size)

    def get_peer_buffer_tensor(self, nvl_rank: int, dtype: torch.dtype, size: Optional[torch.Size] = None,
                               offset: int = 0) -> torch.Tensor:
        """
        pyep extension: views NVLink peer `nvl_rank`'s buffer as mapped in this process (after sync). Writes
        through it land in the peer's buffer.

        Arguments:
            nvl_rank: the peer's index in this rank's NVLink domain (`rank % 8` within a node).
            dtype, size, offset: as in `get_local_buffer_tensor`.

        Returns:
            tensor: a 1-D tensor of `dtype` (or shaped `size`) over the peer's memory.
        """
        return _shaped(self.runtime.get_local_buffer_tensor(dtype, offset, False, nvl_rank), size)
