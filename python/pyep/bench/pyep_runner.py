"""pyep through the shared drivers, with its extension: the launch stamp of the cuda backend."""
from typing import Callable, Optional, Tuple

import torch.distributed as dist

import pyep
from .ep_runner import CONFIG_FIELDS, EPRunner
from .ll_runner import LowLatencyRunner


class PyepRunner(EPRunner):
    """pyep.Buffer. The recommended Configs are pyep's own (`get_dispatch_config` / `get_combine_config` after
    `set_num_sms`: a tuning file's where there is one, else DeepEP V1's table; FP8 dispatch: the tuning file's FP8
    entry where there is one, as a dispatch without a config takes)."""

    name = "pyep"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(pyep, group)

    def recommended(self, kind: str, num_sms: int) -> Tuple[int, ...]:
        saved = pyep.Buffer.num_sms
        try:
            pyep.Buffer.set_num_sms(num_sms)
            get = {"dispatch": pyep.Buffer.get_dispatch_config, "combine": pyep.Buffer.get_combine_config,
                   "dispatch_fp8": pyep.Buffer._get_dispatch_fp8_config}[kind]  # FP8: what a dispatch without a config takes
            cfg = get(self.num_ranks)
        finally:
            pyep.Buffer.num_sms = saved
        return tuple(int(getattr(cfg, n)) for n in CONFIG_FIELDS)

    def open(self, cases) -> None:
        super().open(cases)
        self.launched = _launch_stamp(self.buffer)

    def low_latency(self, ranks_per_node: int = 0) -> LowLatencyRunner:
        """The low-latency runner; ranks_per_node k > 0: its Buffer made with PYEP_RANKS_PER_NODE=k (emulated nodes)."""
        return LowLatencyRunner(self.name, self.module, self.group, launched_of=_launch_stamp,
                                ranks_per_node=ranks_per_node)


def _launch_stamp(buffer: pyep.Buffer) -> Optional[Callable[[], float]]:
    """The cuda backend stamps its latest kernel launch (CLOCK_MONOTONIC, the clock of time.perf_counter): a reader of
    the stamp of `buffer` (None on cpu)."""
    if buffer.runtime.backend != "cuda":
        return None
    rid = buffer.runtime.id
    return lambda: pyep._core.call("BufferLastLaunchNs", rid) / 1e9
