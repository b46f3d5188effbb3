"""Timing of one measurement: device time (CUDA events, L2 flushed), host time, and a hooked call's two phases."""
import time
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch


class Timer:
    """CUDA events around each call with L2 flushed before each timed call (GPU), or time.perf_counter (cpu)."""

    def __init__(self, device: torch.device, flush_mb: int) -> None:
        self.cuda = device.type == "cuda"
        self.flush = None
        if self.cuda and flush_mb > 0:
            self.flush = torch.empty(flush_mb * (1 << 20) // 4, dtype=torch.int32, device=device)

    def run(self, fn: Callable[[], object], warmup: int, iters: int) -> List[float]:
        """Seconds of each of `iters` calls after `warmup` untimed ones."""
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if self.flush is not None:
                self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]

    def phases(self, send: Callable[[], Callable[[], None]], between: Callable[[], None], warmup: int,
               iters: int) -> Tuple[List[float], List[float]]:
        """Seconds of the send phase and of the receive phase of each of `iters` hooked calls after `warmup` untimed
        ones. `send` issues a call with return_recv_hook=True and returns its hook; the hook is timed apart, after
        the device finished the send phase and `between` (a barrier) let every rank's send phase finish too, so that
        the receive phase finds its data there (as DeepEP's test times it, with a GEMM in between)."""
        for _ in range(warmup):
            hook = send()
            self._idle(between)
            hook()
        sends: List[float] = []
        recvs: List[float] = []
        if not self.cuda:
            for _ in range(iters):
                t0 = time.perf_counter()
                hook = send()
                sends.append(time.perf_counter() - t0)
                between()
                t0 = time.perf_counter()
                hook()
                recvs.append(time.perf_counter() - t0)
            return sends, recvs
        torch.cuda.synchronize()
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(iters)]
        for e in ev:
            if self.flush is not None:
                self.flush.zero_()
            e[0].record()
            hook = send()
            e[1].record()
            self._idle(between)
            e[2].record()
            hook()
            e[3].record()
        torch.cuda.synchronize()
        return [e[0].elapsed_time(e[1]) / 1e3 for e in ev], [e[2].elapsed_time(e[3]) / 1e3 for e in ev]

    def _idle(self, between: Callable[[], None]) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        between()

    def host(self, fn: Callable[[], object], wait: Callable[[object], None], iters: int,
             launched: Optional[Callable[[], float]] = None,
             before: Optional[Callable[[], None]] = None) -> "HostTimes":
        """Host time of `iters` calls of `fn` (the usual call), each with the device idle before it (after `before`: a
        barrier that keeps the ranks in step, and for a dispatch its new layout, for a combine its dispatch):
        - calls: seconds from the Python call to its return, nothing synchronized inside;
        - launches (with `launched`, the time.perf_counter clock reading right after the implementation's
          latest kernel launch): seconds from the Python call to its last launch;
        - results: seconds from the Python call until its result is ready: the call returned and the device
          synchronized (on cpu, the call's return).
        `wait` joins the call's event afterwards, outside the clocks."""
        out = HostTimes([], [], [])
        for _ in range(iters):
            if before is not None:
                before()
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            t1 = time.perf_counter()
            if self.cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            # The stamp is read after the clocks stop: synchronizing launches nothing.
            if launched is not None:
                out.launches.append(launched() - t0)
            out.calls.append(t1 - t0)
            out.results.append(t2 - t0)
            wait(r)
        if self.cuda:
            torch.cuda.synchronize()
        return out


class HostTimes(NamedTuple):
    """Seconds of each host-timed call (see Timer.host); launches is empty without a launch stamp."""
    calls: List[float]
    launches: List[float]
    results: List[float]
