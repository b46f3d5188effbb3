"""Events and small helpers shared by the Buffer API."""
from typing import Any, Optional, Tuple

import torch


class EventHandle:
    """A point in a stream's work. On CUDA it records a torch.cuda.Event on the current stream;
    on the cpu backend every operation has finished when its call returns, so the event is
    complete when made."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.event = None
        if device is not None and device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
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
