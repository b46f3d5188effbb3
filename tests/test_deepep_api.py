"""pyep against DeepEP V1's public surface, name for name.

The tables below were written from DeepEP 1.2.x (commit 9249c25): deep_ep/__init__.py, deep_ep/buffer.py,
deep_ep/utils.py and the pybind11 module of csrc/deep_ep.cpp (Config, topk_idx_t). They list every public name of
the module `deep_ep` and every public method and attribute of Buffer, Config and EventOverlap, with each method's
parameters in order, their defaults, and whether it is a staticmethod. pyep must match them; what pyep has beyond
them is listed as its extensions (the README documents them). Runs on the cpu backend and with
PYEP_TEST_DEVICE=cuda."""
import inspect

import pytest
import torch

import pyep

REQUIRED = inspect.Parameter.empty
METHOD, STATIC = "method", "static"

# deep_ep's public names: `from .utils import EventOverlap`, `from .buffer import Buffer`,
# `from deep_ep_cpp import Config, topk_idx_t`.
MODULE_NAMES = ("Buffer", "Config", "EventOverlap", "topk_idx_t")
# pyep's own public names besides (README: errors, EventHandle, __version__).
MODULE_EXTENSIONS = ("EventHandle", "NotAvailableError", "PyepError", "__version__")

_LAYOUT_TAIL = (("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False))
_DISPATCH_HEAD = (("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                  ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                  ("expert_alignment", 1))
_COMBINE = (("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None), ("config", None)) + _LAYOUT_TAIL

# deep_ep.Buffer: name -> (kind, ((parameter, default), ...)) without self.
BUFFER = {
    "__init__": (METHOD, (("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                          ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                          ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None))),
    "destroy": (METHOD, ()),
    "is_sm90_compiled": (STATIC, ()),
    "set_num_sms": (STATIC, (("new_num_sms", REQUIRED),)),
    "capture": (STATIC, ()),
    "get_low_latency_rdma_size_hint": (STATIC, (("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                                ("num_ranks", REQUIRED), ("num_experts", REQUIRED))),
    "get_comm_stream": (METHOD, ()),
    "get_local_buffer_tensor": (METHOD, (("dtype", REQUIRED), ("size", None), ("offset", 0), ("use_rdma_buffer", False))),
    "get_dispatch_config": (STATIC, (("num_ranks", REQUIRED),)),
    "get_combine_config": (STATIC, (("num_ranks", REQUIRED),)),
    "get_dispatch_layout": (METHOD, (("topk_idx", REQUIRED), ("num_experts", REQUIRED)) + _LAYOUT_TAIL),
    "dispatch": (METHOD, _DISPATCH_HEAD + (("num_worst_tokens", 0), ("config", None)) + _LAYOUT_TAIL),
    "combine": (METHOD, _COMBINE),
    "internode_dispatch": (METHOD, _DISPATCH_HEAD + (("config", None),) + _LAYOUT_TAIL),
    "internode_combine": (METHOD, _COMBINE),
    "clean_low_latency_buffer": (METHOD, (("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                          ("num_experts", REQUIRED))),
    "low_latency_dispatch": (METHOD, (("x", REQUIRED), ("topk_idx", REQUIRED), ("num_max_dispatch_tokens_per_rank", REQUIRED),
                                      ("num_experts", REQUIRED), ("cumulative_local_expert_recv_stats", None),
                                      ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
                                      ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False))),
    "low_latency_combine": (METHOD, (("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED), ("handle", REQUIRED),
                                     ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                                     ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None))),
    "low_latency_update_mask_buffer": (METHOD, (("rank_to_mask", REQUIRED), ("mask", False))),
    "low_latency_query_mask_buffer": (METHOD, (("mask_status", REQUIRED),)),
    "low_latency_clean_mask_buffer": (METHOD, ()),
    "get_next_low_latency_combine_buffer": (METHOD, (("handle", REQUIRED),)),
}
# Set by deep_ep.Buffer.__init__ (num_sms is a class attribute). DeepEP also sets nvshmem_qp_depth, internode and
# low-latency mode only.
BUFFER_ATTRIBUTES = ("num_sms", "rank", "group", "group_size", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode",
                     "explicitly_destroy", "enable_shrink", "runtime")
BUFFER_EXTENSIONS = ("is_available", "get_peer_buffer_tensor")

# deep_ep_cpp.Config (pybind11): __init__ with py::arg names and defaults, so positional or by keyword; the two hints
# are bound without names (positional only in DeepEP; the names are config.hpp's).
CONFIG = {
    "__init__": (METHOD, (("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
                          ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256))),
    "get_nvl_buffer_size_hint": (METHOD, (("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED))),
    "get_rdma_buffer_size_hint": (METHOD, (("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED))),
}
# pyep's Config shows its fields (DeepEP's binding has no attributes).
CONFIG_EXTENSIONS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

EVENT_OVERLAP = {
    "__init__": (METHOD, (("event", None), ("extra_tensors", None))),
    "current_stream_wait": (METHOD, ()),
    "__enter__": (METHOD, ()),
    "__exit__": (METHOD, (("exc_type", REQUIRED), ("exc_val", REQUIRED), ("exc_tb", REQUIRED))),
}
EVENT_OVERLAP_ATTRIBUTES = ("event", "extra_tensors")

TABLES = {"Buffer": (pyep.Buffer, BUFFER), "Config": (pyep.Config, CONFIG), "EventOverlap": (pyep.EventOverlap, EVENT_OVERLAP)}

# Internode methods, with arguments of the right shape: each raises NotAvailableError naming itself.
NOT_YET = {
    "internode_dispatch": lambda b: b.internode_dispatch(torch.zeros(4, 128, dtype=torch.bfloat16)),
    "internode_combine": lambda b: b.internode_combine(torch.zeros(4, 128, dtype=torch.bfloat16), ()),
}
# Low-latency methods: on a buffer without low_latency_mode they raise ValueError naming the method, on every backend.
# tests/test_low_latency.py runs them.
LOW_LATENCY = {
    "clean_low_latency_buffer": lambda b: b.clean_low_latency_buffer(128, 7168, 256),
    "low_latency_dispatch": lambda b: b.low_latency_dispatch(torch.zeros(4, 128, dtype=torch.bfloat16),
                                                             torch.zeros(4, 2, dtype=pyep.topk_idx_t), 128, 8),
    "low_latency_combine": lambda b: b.low_latency_combine(torch.zeros(1, 4, 128, dtype=torch.bfloat16),
                                                           torch.zeros(4, 2, dtype=pyep.topk_idx_t), torch.ones(4, 2), ()),
    "low_latency_update_mask_buffer": lambda b: b.low_latency_update_mask_buffer(0, True),
    "low_latency_query_mask_buffer": lambda b: b.low_latency_query_mask_buffer(torch.zeros(1, dtype=torch.int32)),
    "low_latency_clean_mask_buffer": lambda b: b.low_latency_clean_mask_buffer(),
    "get_next_low_latency_combine_buffer": lambda b: b.get_next_low_latency_combine_buffer(()),
}


def public(cls) -> set:
    """The public names a class defines, through its bases but not object's."""
    return {n for n in dir(cls) if not n.startswith("_") and not hasattr(object, n)}


def test_module_names():
    for name in MODULE_NAMES:
        assert hasattr(pyep, name), f"pyep.{name} is missing"
    assert pyep.topk_idx_t is torch.int64, "DeepEP's default build (TOPK_IDX_BITS=64)"
    assert set(pyep.__all__) == set(MODULE_NAMES) | set(MODULE_EXTENSIONS)
    assert issubclass(pyep.NotAvailableError, pyep.PyepError) and issubclass(pyep.NotAvailableError, NotImplementedError)


@pytest.mark.parametrize("cls_name,name", [(c, n) for c, (_, table) in TABLES.items() for n in table])
def test_signature(cls_name, name):
    cls, table = TABLES[cls_name]
    kind, want = table[name]
    assert name in vars(cls) or any(name in vars(base) for base in cls.__mro__[1:-1]), f"{cls_name}.{name} is missing"
    static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    assert static == (kind == STATIC), f"{cls_name}.{name}: staticmethod is {static}, DeepEP's is {kind == STATIC}"
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    if kind == METHOD:
        assert params and params[0].name == "self", f"{cls_name}.{name} is not an instance method"
        params = params[1:]
    got = [(p.name, p.default) for p in params]
    assert [n for n, _ in got] == [n for n, _ in want], f"{cls_name}.{name}: parameters in DeepEP's order"
    for (n, default), (_, want_default) in zip(got, want):
        assert default == want_default and type(default) is type(want_default), f"{cls_name}.{name}: default of {n}"
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY) for p in params), f"{cls_name}.{name}: no *args"


@pytest.mark.parametrize("cls_name,others", [("Buffer", BUFFER_EXTENSIONS + ("num_sms",)), ("Config", CONFIG_EXTENSIONS),
                                             ("EventOverlap", ())])
def test_no_public_name_outside_the_tables(cls_name, others):
    """The tables list everything: pyep's public names are DeepEP's methods, class attributes and documented
    extensions."""
    cls, table = TABLES[cls_name]
    assert public(cls) == {n for n in table if not n.startswith("_")} | set(others)


def test_config_positional_as_deepep():
    config = pyep.Config(24, 6, 256, 6, 128)
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens) == (24, 6, 256)
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0


def test_event_overlap_attributes():
    event = pyep.EventOverlap()
    for name in EVENT_OVERLAP_ATTRIBUTES:
        assert hasattr(event, name)
    with event:
        pass


def test_is_sm90_compiled():
    assert pyep.Buffer.is_sm90_compiled() is hasattr(torch, "float8_e4m3fn")


@pytest.fixture(scope="module")
def buffer(group):
    buffer = pyep.Buffer(group, 1 << 20)
    yield buffer


def test_buffer_attributes(buffer, group):
    for name in BUFFER_ATTRIBUTES:
        assert hasattr(buffer, name), f"Buffer.{name} is missing"
    assert buffer.group is group and (buffer.explicitly_destroy, buffer.enable_shrink) == (False, False)


@pytest.mark.parametrize("name", sorted(NOT_YET))
def test_not_yet_available_raises_naming_the_method(buffer, name):
    assert name in BUFFER
    with pytest.raises(pyep.NotAvailableError, match=rf"^Buffer\.{name}: .* is not available in pyep yet$"):
        NOT_YET[name](buffer)


@pytest.mark.parametrize("name", sorted(LOW_LATENCY))
def test_low_latency_method_on_a_normal_buffer(buffer, name):
    assert name in BUFFER
    with pytest.raises(ValueError, match=rf"^Buffer\.{name}: the buffer was made with low_latency_mode=False$"):
        LOW_LATENCY[name](buffer)
