"""pyep through the shared driver, with its extension: the launch stamp of the cuda backend."""
from typing import Tuple

import torch.distributed as dist

import pyep
from .ep_runner import CONFIG_FIELDS, EPRunner


class PyepRunner(EPRunner):
    """pyep.Buffer. The recommended Configs are pyep's own (`get_dispatch_config` / `get_combine_config` after
    `set_num_sms`: a tuning file's where there is one, else DeepEP V1's table)."""

    name = "pyep"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(pyep, group)

    def recommended(self, kind: str, num_sms: int) -> Tuple[int, ...]:
        saved = pyep.Buffer.num_sms
        try:
            pyep.Buffer.set_num_sms(num_sms)
            cfg = (pyep.Buffer.get_dispatch_config if kind == "dispatch" else pyep.Buffer.get_combine_config)(self.num_ranks)
        finally:
            pyep.Buffer.num_sms = saved
        return tuple(int(getattr(cfg, n)) for n in CONFIG_FIELDS)

    def open(self, cases) -> None:
        super().open(cases)
        # The cuda backend stamps its latest kernel launch (CLOCK_MONOTONIC, the clock of time.perf_counter).
        if self.buffer.runtime.backend == "cuda":
            rid = self.buffer.runtime.id
            self.launched = lambda: pyep._core.call("BufferLastLaunchNs", rid) / 1e9
