"""Buffer: DeepEP V1's expert-parallel communication buffer, over pyep's Go core (normal mode: _normal.py)."""
import atexit
import operator
import socket
import weakref
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import _core
from ._internode import InternodeMixin
from ._low_latency import LowLatencyMixin
from ._runtime import _Runtime, _backend_for
from ._tensors import _shaped
from ._normal import NormalMode, topk_idx_t  # noqa: F401 (topk_idx_t is pyep's API)
from .config import Config
from .tuning import load_tuned
from .utils import EventHandle, EventOverlap


# Buffers not yet released, destroyed at interpreter exit so no shared memory outlives it.
_live: "weakref.WeakSet[Buffer]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    # In creation order, the same on every rank: on cuda, destroying a buffer waits until every peer has released
    # its mapping, which a peer does when it destroys the same buffer, so ranks must go through them alike (a
    # WeakSet's order differs between processes, and two ranks each waiting on another buffer would both time out).
    for buffer in sorted(_live, key=lambda b: b.runtime.id if getattr(b, "runtime", None) is not None else -1):
        buffer._release()


def _as_int(name: str, value: object) -> int:
    """An int argument; like DeepEP's binding, anything with __index__ (numpy integers) is one, bool is not."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _as_flag(name: str, value: object) -> bool:
    """A bool argument: bool, numpy's bool, or the ints 0 and 1."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if isinstance(value, bool) or numpy_bool or isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def _host() -> Tuple[Optional[str], str]:
    """What says that two processes run on one machine (one kernel): the boot id, which containers on a host share,
    and the host name where the boot id cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    return boot, socket.gethostname()


class Buffer(NormalMode, LowLatencyMixin, InternodeMixin):
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
        explicitly_destroy, enable_shrink: the constructor's flags.

    Low-latency mode (`low_latency_dispatch`, ...) runs on the cpu backend (across nodes too, which
    PYEP_RANKS_PER_NODE=k emulates: each k consecutive ranks are one node) and on the cuda backend within one node
    (docs/low-latency.md). Internode normal mode (`internode_dispatch`, ...) and low-latency mode across nodes on cuda
    (NVSHMEM) have DeepEP's methods and signatures and raise `pyep.NotAvailableError` until pyep implements them.
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
            num_nvl_bytes, num_rdma_bytes, num_qps_per_rank: ints (or anything with `__index__`, e.g. numpy integers).
            num_nvl_bytes: bytes of the intranode buffer, a multiple of 128 (see `Config.get_nvl_buffer_size_hint`).
            num_rdma_bytes: bytes of the RDMA buffer, a multiple of 128; needs more than 8 ranks or low-latency mode.
            low_latency_mode: whether to enable low-latency mode (`low_latency_dispatch`, ...; docs/low-latency.md): the
                RDMA buffers are shared between the ranks of a node (cuda) or of the machine (cpu, across nodes too).
            num_qps_per_rank: RDMA queue pairs per rank (NVSHMEM/IBGDA), positive.
            allow_nvlink_for_low_latency_mode: whether low-latency traffic to a peer of the same node may use NVLink.
                With False the cpu backend reaches every peer, its own node's too, through the path of peers on other
                nodes (put, then signal), as DeepEP sends everything over RDMA then; the results are the same. The
                cuda backend ignores it (it has no RDMA path yet).
            allow_mnnvl: whether an NVLink domain (up to 8 ranks) may span hosts (multi-node NVLink). pyep does not
                have MNNVL yet: with True, a group whose NVLink domain spans hosts raises `pyep.NotAvailableError`
                naming `allow_mnnvl`; one on a single host needs nothing from it.
            use_fabric: on cuda, whether the intranode buffer is cuMem memory shared through a fabric handle (where the
                GPU, the driver and an IMEX channel allow) or else, saying why once on stderr, through a POSIX file
                descriptor passed over a Unix socket, instead of CUDA IPC; PYEP_MEM_HANDLE=auto|fabric|fd, read when the
                buffer is made, forces the kind. Either way within one node. The cpu backend ignores it.
            explicitly_destroy: if set, `destroy()` must be called to release resources; otherwise they are released
                when the buffer is collected (and at interpreter exit).
            enable_shrink: whether ranks may be masked out after a failure; needs `low_latency_mode=True` (ValueError
                otherwise).
            comm: an mpi4py communicator to use instead of `group` for the setup exchanges (then `group` is `comm`).
        """
        num_nvl_bytes, num_rdma_bytes, num_qps_per_rank = (_as_int(n, v) for n, v in (
            ("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes), ("num_qps_per_rank", num_qps_per_rank)))
        low_latency_mode, allow_nvlink, allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink = (
            _as_flag(n, v) for n, v in (("low_latency_mode", low_latency_mode),
                                        ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                                        ("allow_mnnvl", allow_mnnvl), ("use_fabric", use_fabric),
                                        ("explicitly_destroy", explicitly_destroy), ("enable_shrink", enable_shrink)))
        self._allow_nvlink_for_low_latency_mode, self._num_qps_per_rank = allow_nvlink, num_qps_per_rank
        if group is not None:
            if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
                raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
            self.rank, self.group_size = group.rank(), group.size()
        elif comm is not None:
            if not all(callable(getattr(comm, m, None)) for m in ("Get_rank", "Get_size", "allgather")):
                raise TypeError("comm must be an mpi4py communicator (Get_rank, Get_size, allgather), "
                                f"got {type(comm).__name__}")
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        else:
            raise ValueError("group: expected a torch.distributed ProcessGroup (or pass comm=, an mpi4py communicator)")
        # As DeepEP's: the group, or the communicator when there is none.
        self.group = group if group is not None else comm
        self._comm = comm if group is None else None
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._comm_stream = None
        self.runtime = _Runtime(_backend_for(group), self.rank, self.group_size, num_nvl_bytes, num_rdma_bytes,
                                low_latency_mode, explicitly_destroy, enable_shrink, use_fabric, allow_nvlink)
        _live.add(self)
        try:
            peers = self._all_gather((self.runtime.get_local_device_id(), _host()))
            # In low-latency mode the RDMA buffer is shared like the NVLink one (its token is in the IPC handle).
            local_handle = self.runtime.get_local_ipc_handle() or None
            if local_handle is not None:
                self._check_hosts([host for _, host in peers], allow_mnnvl)
            device_ids = [device_id for device_id, _ in peers]
            ipc_handles = self._all_gather(local_handle)
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

    def _check_hosts(self, hosts: list, allow_mnnvl: bool) -> None:
        """Raises, on every rank alike, if an NVLink domain spans machines: pyep shares a domain's buffers within one
        machine (shared memory, CUDA IPC, or use_fabric's handles, which it opens on one node only)."""
        by_boot = all(boot is not None for boot, _ in hosts)
        n = self.runtime._num_nvl_ranks
        for first in range(0, len(hosts), n):
            domain = hosts[first:first + n]
            machines = {boot if by_boot else name for boot, name in domain}
            if len(machines) == 1:
                continue
            names = ", ".join(sorted({name for _, name in domain}))
            where = (f"ranks {first}-{first + len(domain) - 1}, one NVLink domain, run on {len(machines)} machines "
                     f"({names})")
            if allow_mnnvl:
                raise _core.not_available("__init__", f"allow_mnnvl=True: {where}: multi-node NVLink (MNNVL)")
            raise _core.PyepError(f"Buffer: {where}; pyep needs the ranks of an NVLink domain (up to 8) on one machine")

    def _all_gather(self, obj: object) -> list:
        if self._comm is not None:
            return list(self._comm.allgather(obj))
        gathered = [None] * self.group_size
        dist.all_gather_object(gathered, obj, self.group)
        return gathered

    def _release(self) -> None:
        self._rows_ahead = None  # rows a layout allocated for the next dispatch (_normal.py)
        self._combine_ahead = None  # the block a dispatch allocated for the next combine (_normal.py)
        self._ll_small_kept = self._ll_out_kept = None  # the last low-latency outputs, handed out again (_low_latency.py)
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
        Whether the FP8 paths exist, which DeepEP has only when it was compiled for SM90. pyep compiles its kernels at
        run time (NVRTC) for the GPU it runs on, and the cpu backend moves FP8 rows as bytes: FP8 dispatch is
        available wherever this PyTorch has `torch.float8_e4m3fn`.

        Returns:
            compiled: True where `torch.float8_e4m3fn` exists.
        """
        return hasattr(torch, "float8_e4m3fn")

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
        Gets pyep's communication stream (cuda backend), created by pyep (non-blocking, highest priority) and shared
        by the Buffers of this process on this GPU: the stream that normal-mode calls with `async_finish`,
        `previous_event` or `allocate_on_comm_stream` run their kernels on, in DeepEP's order. The usual call (none
        of the three) runs its kernels on the current stream, which orders them as DeepEP's two stream waits would;
        `PYEP_COMM_STREAM=1` runs every call here. Low-latency calls run on the current stream.

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

    @staticmethod
    def _get_dispatch_fp8_config(num_ranks: int) -> Config:
        """The config a dispatch of FP8 rows without one takes: the tuning file's dispatch_fp8 entry for
        `Buffer.num_sms` where there is one (FP8 rows are half as wide), else `get_dispatch_config`'s."""
        return load_tuned("dispatch_fp8", num_ranks, Buffer.num_sms) or Buffer.get_dispatch_config(num_ranks)

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
