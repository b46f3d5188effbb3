"""DeepEP V1 beside pyep: importing it, when it can run, and its runner."""
import importlib
import os
from typing import Optional, Tuple

import torch.distributed as dist

import pyep
from .ep_runner import CONFIG_FIELDS, EPRunner

# DeepEP V1's intranode kernels are instantiated for these group sizes only (SWITCH_RANKS in its launch.cuh).
INTRANODE_RANKS = (2, 4, 8)
# A test aid: let the bench try `deep_ep` on the cpu backend (tests drive the DeepEP path with a stand-in module).
ENV_ON_CPU = "PYEP_BENCH_DEEPEP_ON_CPU"


def _import_deepep() -> Tuple[object, dict]:
    """(module or None, {"version", "skipped"}) for DeepEP; never raises."""
    try:
        mod = importlib.import_module("deep_ep")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, {"version": None, "skipped": f"import deep_ep failed: {type(e).__name__}: {e}"}
    if mod is pyep or getattr(mod, "__name__", "") == "pyep" or os.path.dirname(getattr(mod, "__file__", "") or "") == os.path.dirname(pyep.__file__):
        return None, {"version": None, "skipped": "deep_ep is pyep itself"}
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            from importlib import metadata
            for dist_name in ("deep_ep", "deep-ep", "deepep"):
                try:
                    version = metadata.version(dist_name)
                    break
                except metadata.PackageNotFoundError:
                    continue
        except ImportError:
            pass
    return mod, {"version": version, "skipped": None}


def why_not(cuda: bool, shared_gpu: bool, num_ranks: int, num_gpus: int) -> Optional[str]:
    """Why DeepEP cannot run in this group (None: it can)."""
    if not cuda and os.environ.get(ENV_ON_CPU) != "1":
        return "cpu backend: DeepEP needs CUDA GPUs"
    if shared_gpu:
        return (f"ranks share a GPU ({num_ranks} ranks on {num_gpus} GPU{'s' if num_gpus != 1 else ''}): "
                "DeepEP needs one GPU per rank")
    return None


class DeepEPRunner(EPRunner):
    """deep_ep.Buffer through DeepEP V1's public API only. Every Config is made as `deep_ep.Config(*numbers)`:
    DeepEP's recommended table, as pyep's core holds it (for group sizes DeepEP has no entry for, 1 and 3 say,
    the next larger domain's), with the case's chunk sizes put in. The numbers are kept here: DeepEP's Config
    has no readable fields."""

    name = "deepep"

    def __init__(self, module, group: dist.ProcessGroup) -> None:
        super().__init__(module, group)
        if self.num_ranks not in INTRANODE_RANKS:
            # Still called: the error shows that the bench's arguments got through to DeepEP's launch.
            self.note = (f"deepep: DeepEP V1's intranode kernels take {', '.join(map(str, INTRANODE_RANKS))} ranks, not "
                         f"{self.num_ranks}: its dispatch and combine are expected to fail (\"Unsupported ranks\")")

    def recommended(self, kind: str, num_sms: int) -> Tuple[int, ...]:
        kind = "dispatch" if kind == "dispatch_fp8" else kind  # DeepEP has one dispatch table
        cfg = pyep.Config._recommended(kind, self.num_ranks, num_sms)  # DeepEP's table, never a tuning file's
        return tuple(int(getattr(cfg, n)) for n in CONFIG_FIELDS)
