"""Buffer: DeepEP V1's expert-parallel communication buffer, over pyep's Go core."""
import atexit
import contextlib
import ctypes
import functools
import os
import weakref
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _core
from .config import Config
from .tuning import load_tuned
from .utils import EventHandle, EventOverlap

# The dtype of expert indices that every API takes (DeepEP's deep_ep.topk_idx_t).
topk_idx_t = torch.int64

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


def _check_tensor(name: str, t: object, dtypes: Tuple[torch.dtype, ...], dims: Tuple[Optional[int], ...],
                  device: torch.device) -> torch.Tensor:
    """Raises TypeError/ValueError naming `name` unless t is a contiguous tensor of one of `dtypes`, shaped
    `dims` (None: any size), on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected " + " or ".join(map(str, dtypes)))
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
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous; pass {name}.contiguous()")
    return t


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}: expected an int >= {low}")
    return value


# Token rows a dispatch moves (BF16 is DeepEP's; the others move as bytes too) and rows combine sums.
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUEUED_DISPATCH = os.environ.get("PYEP_QUEUED_DISPATCH", "1") != "0"


# The stream order flags of the core's normal-mode calls (orderBefore, orderAfter in pyep/cuda.go).
_ORDER_BEFORE, _ORDER_AFTER = 1, 2


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


class Buffer:
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
        self._queued_rows = 0  # the most rows a queued dispatch of this rank had to redo
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
    def is_sm90_compiled() -> bool:
        """
        Whether the SM90 features (FP8 dispatch) are available, DeepEP's build-time flag. pyep compiles its kernels
        at run time for the GPU present and moves FP8 rows as bytes, on every backend: always True.
        """
        return True

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

    # ---- normal mode -------------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        device = self.__dict__.get("_device_cached")
        if device is None:
            dev = self.runtime.get_local_device_id()
            device = self._device_cached = torch.device("cpu") if dev < 0 else torch.device("cuda", dev)
        return device

    def _queues_dispatch(self) -> bool:
        """Whether a dispatch queues its data phase behind notify (cuda; PYEP_QUEUED_DISPATCH=0 turns it off)."""
        return self._device().type == "cuda" and _QUEUED_DISPATCH

    def _multi_domain(self) -> bool:
        """Whether the group spans NVLink domains (fixed for the buffer's life)."""
        multi = self.__dict__.get("_multi_domain_cached")
        if multi is None:
            multi = self._multi_domain_cached = self.runtime.get_num_rdma_ranks() > 1
        return multi

    def _events(self, previous_event: Optional[EventOverlap], async_finish: bool,
                allocate_on_comm_stream: bool) -> Optional[tuple]:
        """Orders the call after its inputs. On cuda (DeepEP's semantics) the communication stream waits for
        previous_event, or else for the current stream, and the current stream waits for the call unless
        async_finish: the result is (comm, the current stream as a raw CUstream, allocate_on_comm_stream, the order
        flags) for _allocating, _finish and the core's calls, which order the streams themselves (_ORDER_BEFORE,
        _ORDER_AFTER). On cpu the host waits and the result is None."""
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True")
        if self.runtime.backend != "cuda":
            if previous_event is not None and previous_event.event is not None:
                previous_event.event.synchronize()
            return None
        comm = self.get_comm_stream()
        # The raw handle and flags to the core's call cost less than torch's Stream objects and events.
        current = torch._C._cuda_getCurrentRawStream(self._device().index)
        handle = previous_event.event if previous_event is not None else None
        order = 0 if async_finish else _ORDER_AFTER
        if handle is not None and handle.event is not None:
            comm.wait_event(handle.event)
        else:
            order |= _ORDER_BEFORE
        return comm, current, allocate_on_comm_stream, order

    @staticmethod
    def _order(streams: Optional[tuple]) -> Tuple[int, int]:
        """The stream and order flags for the core's call (none on cpu)."""
        return (0, 0) if streams is None else (streams[1], streams[3])

    @staticmethod
    def _allocating(streams: Optional[tuple]):
        """Where outputs are allocated: on the communication stream with allocate_on_comm_stream."""
        if streams is not None and streams[2]:
            return torch.cuda.stream(streams[0])
        return contextlib.nullcontext()

    def _finish(self, async_finish: bool, tensors: tuple, streams: Optional[tuple] = None) -> EventOverlap:
        if streams is None:
            # The cpu backend has finished when its call returns: the event is already complete.
            return EventOverlap(EventHandle(), tensors) if async_finish else EventOverlap(None)
        comm, _, on_comm, _ = streams
        if not async_finish:
            return EventOverlap(None)  # the core's call made the current stream wait (_ORDER_AFTER)
        # The tensors stay allocated until the communication stream is past this call (and, when they were
        # allocated there, until the compute stream is past what it has queued so far).
        compute = torch.cuda.current_stream() if on_comm else None
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(comm)
                if on_comm:
                    t.record_stream(compute)
        return EventOverlap(EventHandle(stream=comm), tensors)

    def _config(self, config: Optional[Config], default) -> Config:
        if config is None:
            return default(self.group_size)
        if not isinstance(config, Config):
            raise TypeError(f"config must be a pyep.Config, got {type(config).__name__}")
        return config

    def _handle_tag(self, handle: tuple) -> tuple:
        return (self.runtime.id,) + tuple(map(id, handle[1:]))

    def _remember(self, handle: tuple) -> tuple:
        # The core takes a handle's tensors as bare addresses (they are pyep's): its first tensor carries the identity
        # of the buffer and of the others, so that only the tuple this buffer returned passes _check_handle.
        handle[0]._pyep_handle = self._handle_tag(handle)
        return handle

    def _check_handle(self, handle: object, length: int) -> tuple:
        if not isinstance(handle, tuple) or len(handle) != length:
            raise ValueError(f"handle: expected the {length}-tuple returned by this buffer's dispatch")
        if getattr(handle[0], "_pyep_handle", None) != self._handle_tag(handle):
            raise ValueError("handle: not returned by a dispatch of this buffer (a handle of another buffer?)")
        return handle

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """
        Calculates the layout a dispatch needs from each token's experts.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `pyep.topk_idx_t` (`torch.int64`), the expert of each of a token's
                top-k choices, `-1` for none; experts are split evenly, rank r holding
                `[r * num_experts / num_ranks, (r + 1) * num_experts / num_ranks)`. An index out of range raises
                ValueError here on the cpu backend; on cuda (which does not wait for the GPU) the next dispatch
                raises it, on every rank.
            num_experts: the number of experts, a multiple of the number of ranks.
            previous_event: an event to wait for before the computation.
            async_finish: whether to return an event instead of making the current stream wait.
            allocate_on_comm_stream: whether the outputs belong to the communication stream (needs previous_event
                and async_finish).

        Returns:
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, the tokens sent to each rank.
            num_tokens_per_rdma_rank: None within one node (`[num_rdma_ranks]` with `torch.int` across nodes).
            num_tokens_per_expert: `[num_experts]` with `torch.int`, the tokens sent to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, whether a token goes to a rank.
            event: the event of the computation (set when `async_finish`).
        """
        device = self._device()
        _check_tensor("topk_idx", topk_idx, (topk_idx_t,), (None, None), device)
        _check_int("num_experts", num_experts, 1)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts = {num_experts}: expected a multiple of num_ranks = {self.group_size}")
        streams = self._events(previous_event, async_finish, allocate_on_comm_stream)
        with self._allocating(streams):
            per_rank = torch.empty(self.group_size, dtype=torch.int32, device=device)
            per_expert = torch.empty(num_experts, dtype=torch.int32, device=device)
            in_rank = torch.empty((topk_idx.size(0), self.group_size), dtype=torch.bool, device=device)
        dl = _DLPack()
        _core.call("Layout", self.runtime.id, dl(topk_idx), num_experts, per_rank.data_ptr(), per_expert.data_ptr(),
                   in_rank.data_ptr(), *self._order(streams))
        per_rdma_rank = None
        if self._multi_domain():
            per_rdma_rank = per_rank.view(-1, 8).sum(1, dtype=torch.int32)
        return per_rank, per_rdma_rank, per_expert, in_rank, self._finish(
            async_finish, (topk_idx, per_rank, per_expert, in_rank), streams)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """
        Sends every token to the ranks that hold its experts (a collective call). Received tokens are ordered by
        source rank, then by the source's token index.

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16` (on the cpu backend also `torch.float16`/`torch.float32`),
                or a tuple of `[num_tokens, hidden]` with `torch.float8_e4m3fn` and its scales `[num_tokens, hidden // 128]`
                with `torch.float`.
            handle: the handle of an earlier dispatch to reuse its layout (cached mode: the same tokens go to the same
                ranks; the top-k arguments and the layout tensors must be None).
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, from `get_dispatch_layout`.
            num_tokens_per_rdma_rank: `[num_rdma_ranks]` with `torch.int`, None within one node.
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, from `get_dispatch_layout`.
            num_tokens_per_expert: `[num_experts]` with `torch.int`, from `get_dispatch_layout`.
            topk_idx: `[num_tokens, num_topk]` with `pyep.topk_idx_t`, the experts of each token (-1 for none), or None.
            topk_weights: `[num_tokens, num_topk]` with `torch.float`, the weights of those experts (with topk_idx).
            expert_alignment: the received token count of each local expert is aligned up to this.
            num_worst_tokens: if positive, the outputs have exactly this many rows (the received tokens first, then
                padding with `recv_topk_idx` -1) and `num_recv_tokens_per_expert_list` is empty; every rank must receive
                at most this many tokens.
            config: the performance config; `get_dispatch_config(num_ranks)` when None.
            previous_event: an event to wait for before the dispatch.
            async_finish: whether to return an event instead of making the current stream wait.
            allocate_on_comm_stream: whether the outputs belong to the communication stream (needs previous_event
                and async_finish).

        Returns:
            recv_x: the received tokens, the same type (tensor or tuple) as `x`, `[num_recv_tokens, hidden]` (on cuda
                a view of rows allocated for the most this rank could receive; see the README, PYEP_QUEUED_DISPATCH).
            recv_topk_idx: `[num_recv_tokens, num_topk]` with `pyep.topk_idx_t`: the local expert index on this rank,
                -1 for experts elsewhere (None in cached mode or without topk_idx).
            recv_topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, 0 where the index is -1 (None likewise).
            num_recv_tokens_per_expert_list: a list of `num_local_experts` ints, the tokens each local expert receives,
                each aligned up to `expert_alignment` (empty with num_worst_tokens; None in cached mode).
            handle: `(rank_prefix_matrix [num_ranks, num_ranks] int32, channel_prefix_matrix [num_ranks, num_channels]
                int32, recv_channel_prefix_matrix [num_ranks, num_channels] int32, recv_src_idx [num_recv_tokens] int32,
                is_token_in_rank [num_tokens, num_ranks] bool, send_head [num_tokens, num_ranks] int32)`, for `combine`
                and cached dispatch (None in cached mode). Pass the tuple itself: only it is accepted. Its int32
                tensors, recv_src_idx, recv_topk_idx, recv_topk_weights and the received scales are views of one
                allocation (recv_x has its own).
            event: the event of the dispatch (set when `async_finish`).
        """
        config = self._config(config, self.get_dispatch_config)
        device = self._device()
        if self._multi_domain():
            raise _core.PyepError(f"dispatch across NVLink domains ({self.group_size} ranks) is not available yet")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if x_scales is None:
            _check_tensor("x", x, _ROW_DTYPES, (None, None), device)
        else:
            _check_tensor("x[0]", x, (torch.float8_e4m3fn,), (None, None), device)
            _check_tensor("x[1]", x_scales, (torch.float32,), (x.size(0), None), device)
        num_tokens, R = x.size(0), self.group_size
        _check_int("expert_alignment", expert_alignment, 1)
        _check_int("num_worst_tokens", num_worst_tokens, 0)
        streams = self._events(previous_event, async_finish, allocate_on_comm_stream)
        stream, order = self._order(streams)
        fields = (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                  config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)
        C = config.num_sms // 2
        rid = self.runtime.id
        dl = _DLPack()

        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("topk_idx, topk_weights: must be None with a handle (cached dispatch)")
            rank_prefix, channel_prefix, _, recv_src_idx, is_token_in_rank, _ = self._check_handle(handle, 6)
            _check_tensor("handle is_token_in_rank", is_token_in_rank, (torch.bool,), (num_tokens, R), device)
            if channel_prefix.size(1) != C:
                raise ValueError(f"config: {C} channels, the handle's dispatch used {channel_prefix.size(1)}")
            rows = recv_src_idx.size(0)
            with self._allocating(streams):
                recv_x = torch.empty((rows, x.size(1)), dtype=x.dtype, device=device)
                recv_scales = None if x_scales is None else torch.empty((rows, x_scales.size(1)), dtype=torch.float32, device=device)
            _core.call("Dispatch", rid, *fields, 0, rows, rows, dl(x), dl(x_scales), 0, 0, dl(is_token_in_rank),
                       rank_prefix.data_ptr(), channel_prefix.data_ptr(), recv_x.data_ptr(), _addr(recv_scales),
                       0, 0, 0, 0, 0, stream, order)
            recv = recv_x if x_scales is None else (recv_x, recv_scales)
            return recv, None, None, None, None, self._finish(
                async_finish, (x, x_scales, is_token_in_rank, rank_prefix, recv_x, recv_scales), streams)

        for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if t is None:
                raise ValueError(f"{name}: required without a handle (from get_dispatch_layout)")
        _check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), (R,), device)
        _check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), (num_tokens, R), device)
        _check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), (None,), device)
        num_experts = num_tokens_per_expert.size(0)
        if num_experts == 0 or num_experts % R:
            raise ValueError(f"num_tokens_per_expert: {num_experts} experts, expected a positive multiple of num_ranks = {R}")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx, topk_weights: pass both or neither")
        K = 0
        if topk_idx is not None:
            _check_tensor("topk_idx", topk_idx, (topk_idx_t,), (num_tokens, None), device)
            _check_tensor("topk_weights", topk_weights, (torch.float32,), (num_tokens, topk_idx.size(1)), device)
            K = topk_idx.size(1)
        S = 0 if x_scales is None else x_scales.size(1)

        # The handle's tensors and num_recv_tokens_per_expert (0-4), then the received rows' small tensors (5-8:
        # recv_src_idx, recv_x_scales, recv_topk_idx, recv_topk_weights) in one allocation, recv_x in its own.
        i32, f32 = torch.int32, torch.float32
        head = ((i32, (R, R)), (i32, (R, C)), (i32, (R, C)), (i32, (num_experts // R,)), (i32, (num_tokens, R)))

        def allocate(rows, specs=()):
            """recv_x and the packed tensors specs + the received rows' (these from index len(specs))."""
            with self._allocating(streams):
                return (torch.empty((rows, x.size(1)), dtype=x.dtype, device=device),
                        _Packed(specs + ((i32, (rows,)), (f32, (rows, S)), (topk_idx_t, (rows, K)), (f32, (rows, K))), device))

        def dispatch(p, at, recv_x, rows):
            """The data phase into rows received rows, after a DispatchNotify."""
            _core.call("Dispatch", rid, *fields, num_experts, num_worst_tokens, rows, dl(x), dl(x_scales), dl(topk_idx),
                       dl(topk_weights), layout[2], h.addr(0), h.addr(1), recv_x.data_ptr(), p.addr(at + 1) if S else 0,
                       p.addr(at), p.addr(at + 2) if K else 0, p.addr(at + 3) if K else 0, 0, h.addr(4),
                       stream, order & _ORDER_AFTER)

        layout = (dl(num_tokens_per_rank), dl(num_tokens_per_expert), dl(is_token_in_rank))
        if num_worst_tokens == 0 and self._queues_dispatch():
            # The data phase is queued behind notify before the counts reach the host, into rows for the most
            # this rank can receive when every rank has as many tokens (or the most seen before); the returned
            # tensors are views of the rows received. If some rank's rows do not fit, nothing moved and the
            # data phase runs again into exact rows.
            capacity = max(R * num_tokens, self._queued_rows, 1)
            recv_x, h = allocate(capacity, head)
            p, at = h, len(head)
            n = _core.call("DispatchQueued", rid, *fields, num_experts, expert_alignment, capacity, *layout,
                           h.addr(0), h.addr(1), h.addr(2), h.addr(3), dl(x), dl(x_scales), dl(topk_idx), dl(topk_weights),
                           recv_x.data_ptr(), h.addr(at + 1) if S else 0, h.addr(at), h.addr(at + 2) if K else 0,
                           h.addr(at + 3) if K else 0, h.addr(4), stream, order)
            if n >= 0:
                rows = n
                if n < capacity:
                    recv_x = recv_x[:n]
            else:
                rows = -n - 1
                self._queued_rows = max(self._queued_rows, rows)
                recv_x, p = allocate(rows)
                at = 0
                dispatch(p, at, recv_x, rows)
        else:
            with self._allocating(streams):
                h = _Packed(head, device)
            rows = _core.call("DispatchNotify", rid, *fields, num_experts, expert_alignment, num_worst_tokens, *layout,
                              h.addr(0), h.addr(1), h.addr(2), h.addr(3), dl(topk_idx), stream, order & _ORDER_BEFORE)
            if num_worst_tokens > 0:
                rows = num_worst_tokens
            recv_x, p = allocate(rows)
            at = 0
            dispatch(p, at, recv_x, rows)
        recv_src_idx = p.view(at, rows)
        recv_scales = p.view(at + 1, rows) if S else None
        recv_topk_idx = p.view(at + 2, rows) if K else None
        recv_topk_weights = p.view(at + 3, rows) if K else None
        handle = self._remember((h.view(0), h.view(1), h.view(2), recv_src_idx, is_token_in_rank, h.view(4)))
        if num_worst_tokens > 0:
            per_expert_list = []
        elif device.type == "cuda":
            # The host's copy from notify: reading the tensor would wait for the streams.
            per_expert_list = list(map(int, _core.call("BufferRecvPerExpert", rid).split()))
        else:
            per_expert_list = h.view(3).tolist()
        recv = recv_x if x_scales is None else (recv_x, recv_scales)
        event = self._finish(async_finish, (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert,
                                            is_token_in_rank, recv_x, h.block, p.block), streams)
        return recv, recv_topk_idx, recv_topk_weights, per_expert_list, handle, event

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """
        Sends the expert outputs back to the ranks their tokens came from and sums them there (without weights;
        a collective call).

        Arguments:
            x: `[num_recv_tokens, hidden]` with `torch.bfloat16` (on the cpu backend also `torch.float16`/`torch.float32`),
                the rows received by the dispatch, in its order (padding rows of num_worst_tokens are ignored).
            handle: the handle returned by the dispatch.
            topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, weights to reduce alongside, or None.
            bias: None, one or a pair of `[num_tokens, hidden]` tensors of x's dtype, added to every combined token.
            config: the performance config; when None, `get_combine_config(num_ranks)` with the dispatch's `num_sms`.
            previous_event: an event to wait for before the combine.
            async_finish: whether to return an event instead of making the current stream wait.
            allocate_on_comm_stream: whether the outputs belong to the communication stream (needs previous_event
                and async_finish).

        Returns:
            combined_x: `[num_tokens, hidden]` of x's dtype: per token, the sum of the copies returned by each rank
                it was sent to (summed in float32, rounded once), plus the bias.
            combined_topk_weights: `[num_tokens, num_topk]` with `torch.float`, the summed weights (None without
                topk_weights).
            event: the event of the combine (set when `async_finish`).
        """
        rank_prefix, _, recv_channel_prefix, src_idx, _, send_head = self._check_handle(handle, 6)
        if config is None:
            # Combine runs on the dispatch's channels: the recommended config with the handle's SM count.
            c = self.get_combine_config(self.group_size)
            config = Config._trusted((2 * recv_channel_prefix.size(1),) + c._fields()[1:])
        config = self._config(config, self.get_combine_config)
        device = self._device()
        num_tokens, R = send_head.size(0), self.group_size
        _check_tensor("x", x, _ROW_DTYPES, (None, None), device)
        if x.size(0) < src_idx.size(0):
            raise ValueError(f"x: {x.size(0)} rows, expected the dispatch's {src_idx.size(0)} received rows")
        if recv_channel_prefix.size(1) != config.num_sms // 2:
            raise ValueError(f"config: {config.num_sms // 2} channels, the handle's dispatch used {recv_channel_prefix.size(1)}"
                             f" (num_sms = {2 * recv_channel_prefix.size(1)})")
        if topk_weights is not None:
            _check_tensor("topk_weights", topk_weights, (torch.float32,), (x.size(0), None), device)
        biases = bias if isinstance(bias, tuple) else (bias,)
        if len(biases) > 2:
            raise ValueError(f"bias: expected None, a tensor or a pair of tensors, got {len(biases)} tensors")
        biases = tuple(biases) + (None,) * (2 - len(biases))
        for i, b in enumerate(biases):
            if b is not None:
                _check_tensor(f"bias[{i}]", b, (x.dtype,), (num_tokens, x.size(1)), device)
        streams = self._events(previous_event, async_finish, allocate_on_comm_stream)
        with self._allocating(streams):
            combined_x = torch.empty((num_tokens, x.size(1)), dtype=x.dtype, device=device)
            combined_weights = None
            if topk_weights is not None:
                combined_weights = torch.empty((num_tokens, topk_weights.size(1)), dtype=torch.float32, device=device)
        dl = _DLPack()
        # Rows past the dispatch's received rows are num_worst_tokens padding: they do not move.
        _core.call("Combine", self.runtime.id, config.num_sms, config.num_max_nvl_chunked_send_tokens,
                   config.num_max_nvl_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens,
                   config.num_max_rdma_chunked_recv_tokens, num_tokens, src_idx.size(0), dl(x), dl(topk_weights),
                   src_idx.data_ptr(), rank_prefix.data_ptr(), recv_channel_prefix.data_ptr(), send_head.data_ptr(),
                   dl(biases[0]), dl(biases[1]), combined_x.data_ptr(), _addr(combined_weights), *self._order(streams))
        return combined_x, combined_weights, self._finish(
            async_finish, (x, topk_weights, src_idx, rank_prefix, recv_channel_prefix, send_head) + biases +
            (combined_x, combined_weights), streams)
