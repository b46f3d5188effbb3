"""The environment a run records: host, software, GPU."""
import ctypes
import datetime
import os
import platform
import socket
import subprocess
from typing import Optional

import torch
import torch.distributed as dist

import pyep
from .gpus import Placement, mps_status


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    return None


def _nccl_loaded() -> Optional[str]:
    """The version of the NCCL library this process has mapped (ncclGetVersion), and its path: torch's
    torch.cuda.nccl.version() gives the version torch was built with, which an LD_PRELOAD of another NCCL (a
    deepep_v2 run) does not change."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "/libnccl.so" in line})
        if not paths:
            return None
        code = ctypes.c_int()
        if ctypes.CDLL(paths[0]).ncclGetVersion(ctypes.byref(code)) != 0:
            return f"unknown ({paths[0]})"
        v = code.value
        return f"{v // 10000}.{v // 100 % 100}.{v % 100} ({', '.join(paths)})"
    except (OSError, AttributeError) as e:
        return f"unknown ({e})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(where: Placement, group: dist.ProcessGroup, deepep: dict, deepep_v2: Optional[dict] = None) -> dict:
    """What a report records of the machine and the run (rank 0's view). gpu_sharing: whether ranks share GPUs
    (then their figures are for correctness, not speed); mps: CUDA MPS as the ranks' CUDA clients find it."""
    device = where.device
    env = {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyep": pyep.__version__,
        "backend": device.type,
        "dist_backend": str(dist.get_backend(group)),
        "num_ranks": group.size(),
        "deep_ep": deepep,
        # DeepEP V2 (--impls deepep_v2) and the NCCL it runs on: the whole process's (LD_PRELOAD), the baseline's too.
        "deep_ep_v2": deepep_v2,
        "nccl_preload": os.environ.get("LD_PRELOAD"),
        "ep_env": {k: os.environ[k] for k in ("EP_NCCL_ROOT_DIR", "EP_DISABLE_GIN", "EP_JIT_CACHE_DIR")
                   if k in os.environ},
        "gpu": None, "gpu_count": 0, "driver": None, "cuda": torch.version.cuda, "nccl": None,
        "gpu_sharing": None, "mps": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_count=torch.cuda.device_count(), driver=_driver_version(),
                   gpu_sms=props.multi_processor_count, gpu_memory_bytes=props.total_memory,
                   gpu_l2_bytes=getattr(props, "L2_cache_size", None),
                   gpu_capability=f"{props.major}.{props.minor}",
                   gpu_sharing={"shared": where.shared, "ranks_per_gpu": where.ranks_per_gpu, "gpus_used": where.gpus},
                   mps=mps_status())
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            env["nccl"] = f"unknown ({e})"
        env["nccl_loaded"] = _nccl_loaded()
    return env
