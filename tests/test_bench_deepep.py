"""pyep.bench's DeepEP path against a stand-in `deep_ep` with exactly DeepEP V1's public Python surface (over
pyep), and the bench's decisions about ranks that share a GPU.

The stand-in is what `import deep_ep` gives the bench's ranks here: a Config with no readable fields, a Buffer
with DeepEP's methods and attributes only (no launch stamp, no get_peer_buffer_tensor, a runtime without pyep's
fields), DeepEP's return tuples and its errors (RuntimeError from the Config's host assertions, AssertionError
for a group size its table lacks). The bench run spawns its own two-rank gloo group, so it runs on rank 0 of the
torchrun launch only."""
import json
import os
import sys
import textwrap

import pytest

from pyep.bench import baseline, deepep_runner, gpus, sweep
import pyep.bench as bench

_PYEP_BACKEND_AT_IMPORT = os.environ.get("PYEP_BACKEND")

# DeepEP V1's Python surface (deep_ep/__init__.py, buffer.py, utils.py and the deep_ep_cpp names it re-exports),
# each forwarded to pyep or refused; nothing else is reachable without a leading underscore.
FAKE_DEEP_EP = textwrap.dedent('''
    """A stand-in for DeepEP V1 (deep_ep 1.2.x): its public Python surface over pyep, nothing more."""
    import weakref

    import torch

    import pyep

    topk_idx_t = torch.int64
    # What each stand-in object wraps, kept out of the objects themselves.
    _inner = weakref.WeakKeyDictionary()
    _TABLE_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


    class Config:
        """deep_ep_cpp.Config: a constructor and two size hints; its fields cannot be read from Python."""
        __slots__ = ("__weakref__",)

        def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                     num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
            try:
                _inner[self] = pyep.Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                                           num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
            except ValueError as e:  # DeepEP's EP_HOST_ASSERT reaches Python as a RuntimeError
                raise RuntimeError(f"Failed: Assertion error ({e})") from None

        def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
            return _inner[self].get_nvl_buffer_size_hint(hidden_bytes, num_ranks)

        def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
            return _inner[self].get_rdma_buffer_size_hint(hidden_bytes, num_ranks)


    def _config(config):
        if not isinstance(config, Config):
            raise TypeError(f"incompatible function arguments: config must be deep_ep_cpp.Config, got {type(config).__name__}")
        return _inner[config]


    class EventHandle:
        """deep_ep_cpp.EventHandle: an event on the current stream; current_stream_wait only."""
        __slots__ = ("__weakref__",)

        def __init__(self):
            _inner[self] = pyep.Buffer.capture()

        def current_stream_wait(self):
            _inner[self].current_stream_wait()


    def _handle(overlap):
        h = EventHandle.__new__(EventHandle)
        _inner[h] = overlap
        return h


    class EventOverlap:
        """deep_ep.utils.EventOverlap."""

        def __init__(self, event=None, extra_tensors=None):
            self.event = event
            self.extra_tensors = extra_tensors

        def current_stream_wait(self):
            assert self.event is not None
            self.event.current_stream_wait()

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc_val, exc_tb):
            if self.event is not None:
                self.event.current_stream_wait()


    def _previous(event):
        return None if event is None else _inner[event.event]


    def _event(overlap, async_finish):
        return EventOverlap(_handle(overlap) if async_finish else None)


    class _Runtime:
        """deep_ep_cpp.Buffer, as much as a caller of deep_ep.Buffer could reach."""
        __slots__ = ("__weakref__",)

        def is_available(self):
            return _inner[self].is_available()

        def get_num_rdma_ranks(self):
            return _inner[self].get_num_rdma_ranks()

        def get_rdma_rank(self):
            return _inner[self].get_rdma_rank()

        def get_local_device_id(self):
            return _inner[self].get_local_device_id()


    def _not_in_stand_in(*args, **kwargs):
        raise NotImplementedError("internode calls and low-latency masks are not in the deep_ep stand-in")


    def _hook(inner_hook):
        """DeepEP's receiving hook: a plain callable (None without return_recv_hook)."""
        if inner_hook is None:
            return None

        def hook():
            inner_hook()
        return hook


    class Buffer:
        """deep_ep.Buffer (normal mode, intranode)."""
        num_sms = 20

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                     allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                     explicitly_destroy=False, enable_shrink=False, comm=None):
            inner = pyep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                                allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy,
                                enable_shrink, comm)
            _inner[self] = inner
            self.rank, self.group, self.group_size = inner.rank, inner.group, inner.group_size
            self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
            self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = low_latency_mode, explicitly_destroy, enable_shrink
            self.runtime = _Runtime()
            _inner[self.runtime] = inner.runtime

        def destroy(self):
            assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
            _inner[self].destroy()
            self.runtime = None

        @staticmethod
        def is_sm90_compiled():
            return True

        @staticmethod
        def set_num_sms(new_num_sms):
            assert new_num_sms % 2 == 0, "The SM count must be even"
            Buffer.num_sms = new_num_sms

        @staticmethod
        def capture():
            return EventOverlap(EventHandle())

        @staticmethod
        def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
            return pyep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                              num_experts)

        def get_comm_stream(self):
            return _inner[self].get_comm_stream()

        def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
            return _inner[self].get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

        @staticmethod
        def _table(kind, num_ranks):
            assert num_ranks in _TABLE_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
            p = pyep.Config._recommended(kind, num_ranks, Buffer.num_sms)
            return Config(p.num_sms, p.num_max_nvl_chunked_send_tokens, p.num_max_nvl_chunked_recv_tokens,
                          p.num_max_rdma_chunked_send_tokens, p.num_max_rdma_chunked_recv_tokens)

        @staticmethod
        def get_dispatch_config(num_ranks):
            return Buffer._table("dispatch", num_ranks)

        @staticmethod
        def get_combine_config(num_ranks):
            return Buffer._table("combine", num_ranks)

        def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                                allocate_on_comm_stream=False):
            r = _inner[self].get_dispatch_layout(topk_idx, num_experts, previous_event=_previous(previous_event),
                                                 async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
            return r[0], r[1], r[2], r[3], _event(r[4], async_finish)

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                     expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                     allocate_on_comm_stream=False):
            config = self.get_dispatch_config(self.group_size) if config is None else config
            r = _inner[self].dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                      _config(config), _previous(previous_event), async_finish, allocate_on_comm_stream)
            return r[0], r[1], r[2], r[3], r[4], _event(r[5], async_finish)

        def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                    async_finish=False, allocate_on_comm_stream=False):
            config = self.get_combine_config(self.group_size) if config is None else config
            r = _inner[self].combine(x, handle, topk_weights, bias, _config(config), _previous(previous_event),
                                     async_finish, allocate_on_comm_stream)
            return r[0], r[1], _event(r[2], async_finish)

        def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
            assert self.low_latency_mode, "low_latency_mode must be set"  # DeepEP's EP_HOST_ASSERT, as in its runtime
            _inner[self].clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                                 use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                                 return_recv_hook=False):
            # (packed_recv_x or (packed_recv_x, packed_recv_x_scales), packed_recv_count, handle, event, hook), handle
            # = (packed_recv_src_info, packed_recv_layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
            recv_x, count, handle, event, hook = _inner[self].low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
            return recv_x, count, tuple(handle), _event(event, async_finish), _hook(hook)

        def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                                async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
            combined_x, event, hook = _inner[self].low_latency_combine(
                x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
                combine_wait_recv_cost_stats)
            return combined_x, _event(event, async_finish), _hook(hook)

        def get_next_low_latency_combine_buffer(self, handle):
            return _inner[self].get_next_low_latency_combine_buffer(handle)

        internode_dispatch = internode_combine = _not_in_stand_in
        low_latency_update_mask_buffer = low_latency_query_mask_buffer = low_latency_clean_mask_buffer = _not_in_stand_in
''')

TINY = ["--spawn", "--device", "cpu", "--nprocs", "2", "--tokens", "64", "--hidden", "256", "--topk", "4",
        "--experts", "8", "--sms", "4", "--ll-tokens", "16", "--ll-experts", "8", "--warmup", "0", "--iters", "1",
        "--host-iters", "2", "--no-plots", "--quiet"]


@pytest.fixture(scope="module")
def fake_deep_ep(tmp_path_factory):
    """The stand-in as the package `deep_ep` on sys.path (the bench's spawned ranks inherit it) and PYTHONPATH."""
    root = tmp_path_factory.mktemp("fake-deep-ep")
    (root / "deep_ep").mkdir()
    (root / "deep_ep" / "__init__.py").write_text(FAKE_DEEP_EP)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    sys.modules.pop("deep_ep", None)
    yield root
    sys.modules.pop("deep_ep", None)
    mp.undo()


@pytest.fixture(scope="module")
def deepep_report(group, fake_deep_ep, tmp_path_factory):
    """One run of every kind of row (issue #19): normal mode of pyep, the baseline and DeepEP; low latency of pyep and
    DeepEP on one node and pyep's on 2 emulated nodes of 1 rank (--ll-nodes 1). PYEP_BENCH_NODES_APART=1 makes the
    launcher run the emulated-node rows as on cuda, in a second set of processes. Returns (report, table.txt, the sets
    of processes spawned)."""
    if group.rank() != 0:
        pytest.skip("not collective: runs on rank 0 only")
    from conftest import record_spawned_sets
    out = tmp_path_factory.mktemp("bench-deepep")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYEP_BACKEND", "cpu")
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.setenv(deepep_runner.ENV_ON_CPU, "1")
    mp.setenv(sweep.NODES_APART_ENV, "1")
    mp.delenv("PYEP_RANKS_PER_NODE", raising=False)
    sets = record_spawned_sets(mp)
    try:
        # Two cases: the recommended chunks, and a send chunk no Config takes (300 >= the recv ring's 256).
        report = bench.main(TINY + ["--impls", "pyep,baseline,deepep", "--nvl-send", "default,300", "--ll-nodes", "1",
                                    "--out", str(out)])
    finally:
        mp.undo()
    assert json.loads((out / "results.json").read_text()) == report
    return report, (out / "table.txt").read_text(), sets


def test_fake_is_deepep_shaped(fake_deep_ep):
    """The stand-in refuses what DeepEP V1 lacks, so that the bench test below catches its use."""
    import deep_ep
    cfg = deep_ep.Config(24, 6, 256, 6, 128)
    for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens"):
        with pytest.raises(AttributeError):
            getattr(cfg, name)
    with pytest.raises(RuntimeError):
        deep_ep.Config(24, 300, 256)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 2) > 0
    for name in ("get_peer_buffer_tensor", "is_available", "get_dispatch_config", "capture", "is_sm90_compiled"):
        assert hasattr(deep_ep.Buffer, name) == (name not in ("get_peer_buffer_tensor", "is_available")), name
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks"):
        deep_ep.Buffer.get_dispatch_config(3)
    assert not hasattr(deep_ep, "__version__")


def test_bench_drives_deepep_api(deepep_report):
    report, table, _ = deepep_report
    assert "deepep" not in report["skipped"], report["skipped"]
    assert report["env"]["deep_ep"] == {"version": None, "skipped": None}
    by = {}
    for r in report["results"]:
        by.setdefault((r["impl"], r["op"], r["nvl_send"]), r)
    for op in bench.OPS:
        send = None
        d, p = by[("deepep", op, send)], by[("pyep", op, send)]
        assert d["error"] is None, (op, d["error"])
        assert d["config"] == p["config"], op  # the bench's numbers: DeepEP's table, which pyep's untuned one is
        if op != "layout":
            assert d["config"][:3] == [4] + p["config"][1:3] and d["num_sms"] == 4
        for dr, pr in zip(d["per_rank"], p["per_rank"]):
            assert dr["recv_tokens"] == pr["recv_tokens"]
            assert dr["launch_us"] is None  # DeepEP has no launch stamp
            assert 0 < dr["host_us"] <= dr["result_us"]
            assert 0 < pr["host_us"] <= pr["result_us"]
        assert d["result_us_avg"] >= d["host_us_avg"] > 0
    # The chunk no Config takes: an error row for every dispatch and combine op of both, DeepEP's a RuntimeError.
    for op in bench.OPS:
        if op == "layout":
            continue
        d, p = by[("deepep", op, 300)], by[("pyep", op, 300)]
        assert d["error"] and "RuntimeError" in d["error"] and "prepare" in d["error"], d["error"]
        assert p["error"] and "ValueError" in p["error"], p["error"]
    assert "deepep" in table and "result" in table and "call" in table


def test_bench_drives_deepep_low_latency(deepep_report):
    """DeepEP's low-latency rows through the stand-in: its own Buffer (low_latency_mode=True), checked, the same
    received rows and bytes as pyep's, both phases of the hooked calls."""
    report, table, _ = deepep_report
    assert not any("low-latency" in k for k in report["skipped"]), report["skipped"]
    ll = {(r["impl"], r["op"]): r for r in report["results"] if r["op"] in bench.LL_OPS and not r["ranks_per_node"]}
    assert set(ll) == {(impl, op) for impl in ("pyep", "deepep") for op in bench.LL_OPS}
    for op in bench.LL_OPS:
        d, p = ll[("deepep", op)], ll[("pyep", op)]
        assert d["error"] is None, (op, d["error"])
        assert (d["tokens"], d["hidden"], d["topk"], d["experts"]) == (16, 256, 4, 8)
        assert d["config"] is None and d["num_sms"] is None
        assert d["ranks_per_node"] == p["ranks_per_node"] == 0  # one node: DeepEP has no emulated nodes
        assert 0 <= d["combine_err_max"] < 0.08
        for dr, pr in zip(d["per_rank"], p["per_rank"]):
            assert dr["recv_tokens"] == pr["recv_tokens"] and dr["bytes"] == pr["bytes"] > 0
            assert dr["launch_us"] is None and 0 < dr["host_us"] <= dr["result_us"]
            assert (dr["send_us"] is None) == (op == "ll_dispatch_combine")
            if dr["send_us"] is not None:
                assert dr["send_us"] > 0 and dr["recv_us"] > 0
    assert "ll_dispatch_combine" in table


def test_bench_one_run_all_rows(deepep_report):
    """Issue #19: one invocation gives one report of every row, the emulated-node rows from the launcher's second set
    of processes (on cuda a process holds one NVSHMEM group, which DeepEP's low-latency Buffer takes) merged after the
    one-node rows, as one run in one set would have them."""
    report, table, sets = deepep_report
    assert sets == [sweep.FIRST, sweep.NODES]
    assert report["skipped"] == {} and report["plan"]["ll_nodes"] == [1]
    assert report["plan"]["impls"] == ["pyep", "baseline", "deepep"] and report["env"]["deep_ep"]["skipped"] is None
    assert any("second set of 2 processes" in n for n in report["plan"]["notes"])
    normal = {(r["impl"], r["op"]) for r in report["results"] if r["op"] not in bench.LL_OPS}
    assert normal == ({(impl, op) for impl in ("pyep", "deepep") for op in bench.OPS}
                      | {("baseline", op) for op in bench.BASELINE_OPS})
    ll = [r for r in report["results"] if r["op"] in bench.LL_OPS]
    keys = [(r["impl"], r["ranks_per_node"], r["num_nodes"]) for r in ll]
    assert keys == [("pyep", 0, 1)] * 3 + [("deepep", 0, 1)] * 3 + [("pyep", 1, 2)] * 3
    one = {r["op"]: r for r in ll if r["impl"] == "pyep" and not r["ranks_per_node"]}
    for r in ll:
        assert r["error"] is None and 0 <= r["combine_err_max"] < 0.08, (r["impl"], r["op"], r["error"])
        assert [p["recv_tokens"] for p in r["per_rank"]] == [p["recv_tokens"] for p in one[r["op"]]["per_rank"]]
    lines = table.splitlines()
    assert sum(" bench: " in line for line in lines) == 1  # one run's header
    nodes = [w[1] for w in map(str.split, lines) if len(w) > 2 and w[2] in bench.LL_OPS]
    assert nodes == ["-"] * 6 + ["2x1"] * 3
    assert lines[-1].startswith("wrote ") and sum(line.startswith("wrote ") for line in lines) == 1


def test_bench_ll_nodes_beside_deepep_in_group(fake_deep_ep, group, tmp_path, monkeypatch):
    """In a process group of the user's (torchrun: no second set of processes can be started), where DeepEP's
    low-latency Buffer ran (on cuda it made the process's NVSHMEM group; on cpu PYEP_BENCH_NODES_APART=1 takes it so):
    the emulated-node rows are skipped, and the reason names the bench's own launcher; the one-node rows run."""
    from conftest import BACKEND
    if BACKEND != "cpu" or group.size() < 2:
        why = "the stand-in runs on the cpu backend" if BACKEND != "cpu" else "one rank: no emulated nodes"
        print(f"\ntest_bench_ll_nodes_beside_deepep_in_group: skipped: {why}", flush=True)
        pytest.skip(why)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(deepep_runner.ENV_ON_CPU, "1")
    monkeypatch.setenv(sweep.NODES_APART_ENV, "1")
    monkeypatch.delenv("PYEP_RANKS_PER_NODE", raising=False)
    argv = TINY[TINY.index("--tokens"):] + ["--device", "cpu", "--ll", "--impls", "pyep,deepep", "--ll-nodes", "1",
                                            "--out", str(tmp_path)]
    report = bench.main(argv)  # no --spawn, a process group: this process is a rank, as under torchrun
    if group.rank() != 0:
        assert report is None
        return
    why = report["skipped"]["pyep low-latency ranks_per_node=1"]
    assert "NVSHMEM" in why and "python -m pyep.bench --nprocs N" in why and "not torchrun" in why, why
    assert {(r["impl"], r["ranks_per_node"]) for r in report["results"]} == {("pyep", 0), ("deepep", 0)}
    assert all(r["error"] is None for r in report["results"]), [r["error"] for r in report["results"]]
    assert f"skipped pyep low-latency ranks_per_node=1: {why}" in (tmp_path / "table.txt").read_text()


def test_fake_low_latency_is_deepep_shaped(fake_deep_ep, group, device):
    """The stand-in's low-latency calls return DeepEP's shapes (collective: each rank its own buffer)."""
    import torch
    import deep_ep
    R, M, H, E, K = group.size(), 8, 256, 4 * group.size(), 2
    buf = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=True)
    try:
        x = torch.randn((M, H), device=device).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).to(device, deep_ep.topk_idx_t)
        (q, s), count, handle, event, hook = buf.low_latency_dispatch(x, idx, M, E, async_finish=True)
        assert q.shape == (E // R, R * M, H) and q.dtype == torch.float8_e4m3fn and s.shape == (E // R, R * M, H // 128)
        assert count.shape == (E // R,) and count.dtype == torch.int32 and hook is None
        assert isinstance(event, deep_ep.EventOverlap) and isinstance(event.event, deep_ep.EventHandle)
        assert len(handle) == 5 and handle[2:] == (M, H, E)
        event.current_stream_wait()
        recv, count, handle, event, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
        assert event.event is None and callable(hook)
        hook()
        assert recv.dtype == torch.bfloat16 and recv.shape == (E // R, R * M, H)
        out, event, hook = buf.low_latency_combine(recv, idx, torch.rand((M, K), device=device), handle)
        assert out.shape == (M, H) and out.dtype == torch.bfloat16 and hook is None and event.event is None
        with pytest.raises(NotImplementedError):
            buf.low_latency_update_mask_buffer(0, True)
    finally:
        buf.destroy()


def test_deepep_skips():
    assert deepep_runner.why_not(False, False, 2, 0).startswith("cpu backend")
    why = deepep_runner.why_not(True, True, 4, 1)
    assert "share a GPU" in why and "4 ranks on 1 GPU" in why and "one GPU per rank" in why
    assert deepep_runner.why_not(True, False, 2, 2) is None
    assert deepep_runner.why_not(True, False, 2, 2) is None
    assert "gloo" in baseline.why_not(True, False, True) and "share a GPU" in baseline.why_not(True, False, True)
    assert baseline.why_not(True, True, False) is None and baseline.why_not(False, False, False) is None


def test_gpu_placement():
    assert [gpus.device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [gpus.device_index(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert gpus.shares_gpus(2, 1) and gpus.shares_gpus(4, 2)
    assert not gpus.shares_gpus(1, 1) and not gpus.shares_gpus(4, 8) and not gpus.shares_gpus(4, 0)


def test_claim_cuda_backend(monkeypatch):
    # setenv, not delenv: monkeypatch then removes what claim_cuda_backend sets (the other tests run on cpu).
    monkeypatch.setenv("PYEP_BACKEND", "")
    gpus.claim_cuda_backend()
    assert os.environ["PYEP_BACKEND"] == "cuda"
    monkeypatch.setenv("PYEP_BACKEND", "cpu")
    with pytest.raises(SystemExit, match="PYEP_BACKEND=cpu"):
        gpus.claim_cuda_backend()


def test_mps_status(tmp_path):
    off = gpus.mps_status({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert off["on"] is False and off["pipe_dir"] == str(tmp_path)
    os.mkfifo(tmp_path / "control")
    on = gpus.mps_status({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert on["on"] is True and on["control"] == str(tmp_path / "control")
    assert gpus.mps_status({})["pipe_dir"] == gpus.MPS_DEFAULT_PIPE_DIR


def test_join_shares_gpus(monkeypatch):
    """The launcher's choice per rank: a GPU a rank over NCCL while there are enough, else round robin over gloo
    with pyep's cuda backend named."""
    import torch
    from pyep.bench import launch
    taken = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    monkeypatch.setenv("PYEP_BACKEND", "")  # undone at the end, whatever _join sets
    assert launch._join(3, 4, True) == "gloo" and taken == [0] and os.environ["PYEP_BACKEND"] == "cuda"
    monkeypatch.setenv("PYEP_BACKEND", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch._join(1, 2, True) == "nccl" and taken == [0, 1] and os.environ["PYEP_BACKEND"] == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch._join(0, 2, False) == "gloo" and taken == [0, 1]


def test_placement_finds_shared_gpus(group, monkeypatch):
    """Collective: a gloo group with PYEP_BACKEND=cuda whose ranks all report one GPU shares it (faked here)."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace
    if "gloo" not in str(dist.get_backend(group)).lower():
        group = dist.new_group(backend="gloo")  # the session's group is NCCL where each rank has a GPU
    monkeypatch.setenv("PYEP_BACKEND", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-fake"))
    where = gpus.placement("auto", group)
    n = group.size()
    assert where.cuda and not where.nccl and where.device == torch.device("cuda", 0)
    assert (where.shared, where.ranks_per_gpu, where.gpus) == (n > 1, n, 1)
    text = where.describe(n, "Fake GPU")
    assert "cuda backend over gloo" in text and "Fake GPU" in text
    assert ("share a GPU" in text) == (n > 1)
    with pytest.raises(SystemExit, match="--device cpu"):
        gpus.placement("cpu", group)
    monkeypatch.setenv("PYEP_BACKEND", "cpu")
    assert not gpus.placement("auto", group).cuda


RUNNER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "deepep", "run_deepep_test.sh")
# Stands in for one of DeepEP's tests: what it imports, and which init_dist its utils.py ended up with.
FAKE_TEST = textwrap.dedent('''
    import argparse, inspect, os, sys
    import deep_ep, pyep
    from utils import init_dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int, default=8)
    parser.parse_args()
    assert deep_ep is pyep and deep_ep.Buffer.is_sm90_compiled()
    source = inspect.getsource(init_dist)
    print("init_dist:", "shared" if "PYEP_BACKEND" in source and "gloo" in source else init_dist(0, 1))
    sys.exit(int(os.environ.get("FAKE_TEST_EXIT", "0")))
''')


def test_run_deepep_test_script(group, tmp_path):
    """bench/deepep/run_deepep_test.sh on a stand-in tests/ directory (no GPU needed: NUM_GPUS says 1)."""
    import subprocess
    if group.rank() != 0:
        pytest.skip("runs on rank 0 only")
    tests = tmp_path / "tests"
    tests.mkdir()
    original = "def init_dist(local_rank, num_local_ranks):\n    return 'deepep'\n"
    (tests / "utils.py").write_text(original)
    (tests / "test_intranode.py").write_text(FAKE_TEST)
    env = dict(os.environ, NUM_GPUS="1", TMPDIR=str(tmp_path))
    env.pop("PYEP_BACKEND", None)

    def run(*args, status=0):
        log = tmp_path / "logs" / "log.txt"
        p = subprocess.run(["bash", RUNNER, str(tests), str(log), "test_intranode.py", *args],
                           env=dict(env, FAKE_TEST_EXIT=str(status)), capture_output=True, text=True, timeout=120)
        return p.returncode, log.read_text() if log.exists() else "", p.stderr + p.stdout

    rc, log, err = run("--num-processes", "2")
    assert rc == 0, err
    assert "init_dist: shared" in log and "ranks share GPUs" in log and "exited with status 0" in log
    rc, log, err = run("--num-processes=1")
    assert rc == 0, err
    assert "init_dist: deepep" in log and "a GPU a rank" in log
    rc, log, err = run("--num-processes", "4", status=3)  # the test's exit status comes back
    assert rc == 3 and "init_dist: shared" in log and "exited with status 3" in log
    assert (tests / "utils.py").read_text() == original  # DeepEP's files are copied, never changed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("deepep-tests.")]  # the copies are removed
    p = subprocess.run(["bash", RUNNER, str(tests)], env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "usage" in p.stderr


def test_deep_ep_shim_is_pyep(tmp_path):
    """PYTHONPATH=bench/deepep makes `import deep_ep` (and `from deep_ep import ...`) give pyep."""
    import subprocess
    shim = os.path.join(os.path.dirname(RUNNER))
    code = "import deep_ep, pyep; from deep_ep import Buffer, Config; assert deep_ep is pyep and Buffer is pyep.Buffer"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_backend_env_restored():
    """The tests above leave PYEP_BACKEND as they found it (pyep's other tests pick their backend by it)."""
    from conftest import shares_gpu
    # Ranks sharing a GPU: conftest's session group set PYEP_BACKEND=cuda after this module was imported.
    assert os.environ.get("PYEP_BACKEND") == ("cuda" if shares_gpu() else _PYEP_BACKEND_AT_IMPORT)
