"""Where the ranks run: one GPU each, or several ranks on one GPU (the one-GPU hosts), and CUDA MPS."""
import os
import socket
from typing import Dict, Optional

import torch
import torch.distributed as dist

# nvidia-cuda-mps-control's pipe directory when CUDA_MPS_PIPE_DIRECTORY is not set.
MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
SHARED_NOTE = ("ranks share a GPU: the figures are for correctness, not speed (the ranks' kernels share one GPU's "
               "SMs and memory, and there is no NVLink between them)")


def device_index(local_rank: int, gpu_count: int) -> int:
    """The GPU of a local rank: one each while there are enough, round robin when ranks outnumber GPUs."""
    return local_rank % gpu_count


def shares_gpus(local_ranks: int, gpu_count: int) -> bool:
    """Whether `local_ranks` ranks on a host with `gpu_count` GPUs must share them. NCCL refuses a communicator
    whose ranks share a GPU, so such a group is gloo, and pyep is told its backend (PYEP_BACKEND=cuda)."""
    return gpu_count > 0 and local_ranks > gpu_count


def claim_cuda_backend() -> None:
    """Sets PYEP_BACKEND=cuda for a gloo group on GPUs (pyep would pick its cpu backend for gloo); refuses
    another value the user set."""
    current = os.environ.get("PYEP_BACKEND")
    if current not in (None, "", "cuda"):
        raise SystemExit(f"PYEP_BACKEND={current}: ranks that share a GPU run pyep's cuda backend over a gloo group; "
                         "unset it, or pass --device cpu for the cpu backend")
    os.environ["PYEP_BACKEND"] = "cuda"


def _gpu_id(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return f"{visible}/{device.index}"


def sharing(group: dist.ProcessGroup, device: torch.device) -> Dict[str, object]:
    """Collective: {"shared": whether two ranks use one GPU, "ranks_per_gpu": the most ranks on one GPU,
    "gpus": distinct GPUs in the group}."""
    ids = [None] * group.size()
    dist.all_gather_object(ids, (socket.gethostname(), _gpu_id(device)), group=group)
    counts: Dict[tuple, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    most = max(counts.values())
    return {"shared": most > 1, "ranks_per_gpu": most, "gpus": len(counts)}


def _mps_daemon_seen() -> Optional[bool]:
    """Whether an MPS control daemon process is visible in /proc (None where /proc cannot be read)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip().startswith("nvidia-cuda-mps"):
                    return True
        except OSError:
            continue
    return False


def mps_status(environ=None) -> Dict[str, object]:
    """CUDA MPS as this process's CUDA clients would find it: on when the control pipe of the daemon exists in
    $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps). `daemon_seen`: whether a daemon process is visible here
    (None: /proc unreadable); a pipe without one is stale, or the daemon runs outside this PID namespace."""
    environ = os.environ if environ is None else environ
    pipe_dir = environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIR
    control = os.path.join(pipe_dir, "control")
    return {"on": os.path.exists(control), "pipe_dir": pipe_dir, "control": control, "daemon_seen": _mps_daemon_seen()}


class Placement:
    """Where this run's ranks are: the device of this rank, whether pyep runs its cuda backend, whether the
    group is NCCL, and whether ranks share GPUs."""

    def __init__(self, device: torch.device, nccl: bool, shared: bool = False, ranks_per_gpu: int = 1,
                 gpus: int = 0) -> None:
        self.device, self.nccl, self.shared, self.ranks_per_gpu, self.gpus = device, nccl, shared, ranks_per_gpu, gpus
        self.cuda = device.type == "cuda"
        self.backend = device.type

    def describe(self, num_ranks: int, gpu_name: Optional[str] = None) -> str:
        """E.g. "2 ranks on 1 GPU (NVIDIA H100; up to 2 ranks share a GPU, MPS off), cuda backend over gloo"."""
        if not self.cuda:
            return f"{num_ranks} ranks, cpu backend"
        about = [gpu_name] if gpu_name else []
        if self.shared:
            about.append(f"up to {self.ranks_per_gpu} ranks share a GPU, MPS {'on' if mps_status()['on'] else 'off'}")
        where = f"{num_ranks} ranks on {self.gpus} GPU{'s' if self.gpus != 1 else ''}"
        if about:
            where += f" ({'; '.join(about)})"
        return f"{where}, cuda backend over {'NCCL' if self.nccl else 'gloo'}"


def placement(device_arg: str, group: dist.ProcessGroup) -> Placement:
    """Collective. An NCCL group runs the cuda backend, each rank on its current GPU; a gloo group runs the cpu
    backend, unless PYEP_BACKEND=cuda says that its ranks are on GPUs (the launcher sets it when ranks share
    GPUs, since NCCL refuses them)."""
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    forced = os.environ.get("PYEP_BACKEND")
    if nccl:
        cuda = True
    elif forced == "cuda":
        if device_arg == "cpu":
            raise SystemExit("--device cpu with PYEP_BACKEND=cuda: unset PYEP_BACKEND for the cpu backend")
        if not torch.cuda.is_available():
            raise SystemExit("PYEP_BACKEND=cuda: no CUDA device is available")
        cuda = True
    elif device_arg == "cuda":
        raise SystemExit("--device cuda on a gloo group needs PYEP_BACKEND=cuda (pyep picks its cpu backend for "
                         "gloo); an NCCL group needs one GPU a rank")
    else:
        cuda = False
    if not cuda:
        return Placement(torch.device("cpu"), nccl)
    device = torch.device("cuda", torch.cuda.current_device())
    s = sharing(group, device)
    return Placement(device, nccl, bool(s["shared"]), int(s["ranks_per_gpu"]), int(s["gpus"]))
