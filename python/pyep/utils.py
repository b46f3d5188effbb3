"""Events and small helpers shared by the Buffer API."""
from typing import Any, Optional, Tuple, Union

import torch


def _as_stream(stream: Union[torch.cuda.Stream, int], device: Optional[torch.device] = None) -> torch.cuda.Stream:
    """A torch stream, or a raw CUstream (an int, e.g. from pyep's core) wrapped as one."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return torch.cuda.ExternalStream(stream, device=device)
    raise TypeError(f"stream must be a torch.cuda.Stream or a raw CUstream (int), got {type(stream).__name__}")


class EventHandle:
    """A point in a stream's work, DeepEP's `EventHandle`: a CUDA event recorded on `stream` (a
    torch.cuda.Stream or a raw CUstream), or else on the current stream of a CUDA `device`. On the cpu
    backend (no device, no stream) every operation has finished when its call returns, so the event is
    complete when made.

    Arguments:
        device: the device whose current stream to record on, when no stream is given.
        stream: the stream to record on.
    """

    def __init__(self, device: Optional[torch.device] = None,
                 stream: Optional[Union[torch.cuda.Stream, int]] = None) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if stream is not None:
            stream = _as_stream(stream, device)
        elif device is not None and torch.device(device).type == "cuda":
            stream = torch.cuda.current_stream(device)
        if stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (the host does not block)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream: Union[torch.cuda.Stream, int]) -> None:
        """Makes `stream` wait for the event (the host does not block)."""
        if self.event is not None:
            _as_stream(stream).wait_event(self.event)

    def query(self) -> bool:
        """Whether the recorded work has completed."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Blocks the host until the recorded work has completed."""
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """A communication event with DeepEP's overlap helpers.

    Arguments:
        event: the `EventHandle` of the operation, or None.
        extra_tensors: tensors kept alive until the event is waited on (for async_finish).
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (which must be set)."""
        assert self.event is not None, "EventOverlap.current_stream_wait: no event (the call was not async_finish)"
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        """For `with` overlap blocks: nothing to do on entry."""
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """On exit, the current stream waits for the event, when there is one."""
        if self.event is not None:
            self.event.current_stream_wait()
