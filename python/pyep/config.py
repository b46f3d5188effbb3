"""Config: DeepEP's performance config of normal mode, checked and sized by the Go core."""
from . import _core


class Config:
    """How normal-mode kernels split work: `num_sms` SMs (two per channel) and ring sizes in tokens.

    Arguments (DeepEP V1's names and defaults):
        num_sms: SMs the kernels may use; even, channels = num_sms / 2.
        num_max_nvl_chunked_send_tokens: tokens a sender pushes into an NVLink ring per step.
        num_max_nvl_chunked_recv_tokens: tokens an NVLink ring holds; more than the send chunk.
        num_max_rdma_chunked_send_tokens: the same for RDMA rings (across NVLink domains).
        num_max_rdma_chunked_recv_tokens: rounded up to whole send chunks; at least two of them.

    Raises ValueError naming the field when a value is out of range.
    """

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        fields = (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                  num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        for name, value in zip(self.__slots__, fields):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config: {name} must be an int, got {type(value).__name__}")
        checked = _core.call("ConfigCheck", *fields).split()
        for name, value in zip(self.__slots__, checked):
            object.__setattr__(self, name, int(value))

    def _fields(self):
        return tuple(getattr(self, n) for n in self.__slots__)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer the rings of this config need for `hidden_bytes` per token among
        `num_ranks` ranks (a buffer at least this large always works)."""
        return _core.call("ConfigSizeHint", *self._fields(), hidden_bytes, num_ranks, False)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer normal mode needs across NVLink domains (0 within one domain)."""
        return _core.call("ConfigSizeHint", *self._fields(), hidden_bytes, num_ranks, True)

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{n}={getattr(self, n)}" for n in self.__slots__) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    @classmethod
    def _trusted(cls, fields) -> "Config":
        """A Config of fields that the core has checked already (no second check: this is on every call's path)."""
        config = cls.__new__(cls)
        for name, value in zip(cls.__slots__, fields):
            object.__setattr__(config, name, value)
        return config

    @classmethod
    def _recommended(cls, kind: str, num_ranks: int, num_sms: int) -> "Config":
        key = (kind, num_ranks, num_sms)
        fields = _RECOMMENDED.get(key)
        if fields is None:
            fields = _RECOMMENDED[key] = tuple(cls(*map(int, _core.call("DefaultConfig", kind, num_ranks, num_sms).split()))._fields())
        return cls._trusted(fields)


# DeepEP's table, as the core answers it, by (kind, num_ranks, num_sms).
_RECOMMENDED = {}
