"""Config, its checks and size hints, and the recommended tables."""
import pytest

import pyep


def test_defaults_and_fields():
    c = pyep.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)
    assert pyep.Config(24, 8, 256, 16, 128).num_max_rdma_chunked_recv_tokens == 128


@pytest.mark.parametrize("args, message", [
    ((3, 6, 256, 6, 128), "num_sms = 3"),
    ((0, 6, 256, 6, 128), "num_sms = 0"),
    ((20, 0, 256, 6, 128), "num_max_nvl_chunked_send_tokens = 0"),
    ((20, 256, 256, 6, 128), "num_max_nvl_chunked_send_tokens = 256: expected fewer"),
    ((20, 6, 256, 0, 128), "num_max_rdma_chunked_send_tokens = 0"),
    ((20, 6, 256, 128, 128), "num_max_rdma_chunked_send_tokens = 128: expected at most half"),
])
def test_invalid(args, message):
    with pytest.raises(ValueError, match=message):
        pyep.Config(*args)


def test_type_checked():
    with pytest.raises(TypeError, match="num_sms must be an int"):
        pyep.Config(20.0)


def test_nvl_size_hint_matches_formula():
    c = pyep.Config(24, 6, 256, 6, 128)
    hidden_bytes, ranks = 7168 * 2, 4
    channels = 12
    n = channels * ranks * (2 * 1 + 3) * 4
    n += channels * ranks * 256 * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    assert c.get_nvl_buffer_size_hint(hidden_bytes, ranks) == (n + 127) // 128 * 128
    assert c.get_rdma_buffer_size_hint(hidden_bytes, ranks) == 0
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 16) > 0
    with pytest.raises(ValueError, match="num_ranks = 9"):
        c.get_nvl_buffer_size_hint(hidden_bytes, 9)


def test_recommended_configs():
    assert pyep.Buffer.get_dispatch_config(4) == pyep.Config(pyep.Buffer.num_sms, 6, 256, 6, 128)
    assert pyep.Buffer.get_combine_config(8) == pyep.Config(pyep.Buffer.num_sms, 4, 256, 6, 128)
    assert pyep.Buffer.get_dispatch_config(3) == pyep.Buffer.get_dispatch_config(4)
    with pytest.raises(ValueError, match="num_ranks = 12: no recommended dispatch config"):
        pyep.Buffer.get_dispatch_config(12)
    # The table is looked up once; every call still gets a Config of its own.
    first, second = pyep.Buffer.get_dispatch_config(4), pyep.Buffer.get_dispatch_config(4)
    assert first == second and first is not second
    first.num_max_nvl_chunked_send_tokens = 1
    assert pyep.Buffer.get_dispatch_config(4).num_max_nvl_chunked_send_tokens == 6


def test_set_num_sms():
    old = pyep.Buffer.num_sms
    try:
        pyep.Buffer.set_num_sms(24)
        assert pyep.Buffer.get_dispatch_config(2).num_sms == 24
        for bad in (3, 0, -2, 2.0, True):
            with pytest.raises(ValueError, match="new_num_sms"):
                pyep.Buffer.set_num_sms(bad)
    finally:
        pyep.Buffer.set_num_sms(old)


def test_drop_in_names():
    import pyep as deep_ep
    assert deep_ep.topk_idx_t is __import__("torch").int64
    with deep_ep.Buffer.capture() as event:
        assert isinstance(event, deep_ep.EventOverlap)
