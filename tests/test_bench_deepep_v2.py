"""pyep.bench's DeepEP V2 column (--impls deepep_v2) against a stand-in `deep_ep` with V2's `ElasticBuffer` signatures
and return tuples (DeepEP's main line at dd758ca, deep_ep/buffers/elastic.py) and a one-rank meaning of them: every
selected token stays on rank 0. It checks the runner's calls, tuple unpacking, handle use, expanded-layout arithmetic,
checks and byte counts, and how the bench records V2's rows; it says nothing about V2's kernels (the GPU run does:
bench/results/). The bench run spawns its own one-rank gloo group, so it runs on rank 0 of a torchrun launch only."""
import json
import os
import sys
import textwrap

import pytest

from pyep.bench import deepep_runner, deepep_v2_runner
import pyep.bench as bench

FAKE_V2 = textwrap.dedent('''
    """Stand-in for DeepEP V2 (one rank): V2's signatures, trivial meaning."""
    import torch
    __version__ = "stand-in"
    topk_idx_t = torch.int64

    class EventOverlap:
        def __init__(self, event=None):
            self.event = event
        def current_stream_wait(self):
            assert self.event is not None

    class EPHandle:
        pass

    class ElasticBuffer:
        def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                     use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True,
                     prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, num_cpu_timeout_secs=300,
                     num_gpu_timeout_secs=100, explicitly_destroy=False):
            assert group.size() == 1
            self.group, self.num_ranks = group, 1
            self.num_max_tokens_per_rank = num_max_tokens_per_rank
            self.num_bytes = 2 << 20
            self.num_scaleout_ranks = self.num_scaleup_ranks = self.num_rdma_ranks = self.num_nvlink_ranks = 1
            self.runtime = object()
            self.explicitly_destroy = explicitly_destroy

        def get_theoretical_num_sms(self, num_experts, num_topk, *a, **k):
            return 4

        def destroy(self):
            assert self.explicitly_destroy
            self.runtime = None

        def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                     num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                     previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                     allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None,
                     do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False):
            assert self.runtime is not None
            x, sf = x if isinstance(x, tuple) else (x, None)
            if sf is not None:
                assert sf.element_size() == 4 and sf.size(0) == x.size(0)
            if handle is not None:
                assert topk_idx is None
                topk_idx, num_experts = handle.topk_idx, handle.num_experts
                num_max_tokens_per_rank, expert_alignment = handle.num_max_tokens_per_rank, handle.expert_alignment
                do_expand, do_cpu_sync = handle.do_expand, False
            num_max_tokens_per_rank = num_max_tokens_per_rank or self.num_max_tokens_per_rank
            expert_alignment = expert_alignment or 1
            do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
            assert x.size(0) <= num_max_tokens_per_rank and num_sms >= 0
            T, K = topk_idx.shape
            valid = topk_idx >= 0
            src = valid.any(dim=1).nonzero().squeeze(1)
            meta = torch.full((src.numel(), 2 + K), -1, dtype=torch.int32)
            meta[:, 0] = src.to(torch.int32)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats += torch.bincount(topk_idx[valid].long(), minlength=num_experts).int()
            if not do_expand:
                rx = x[src]
                rsf = sf[src] if sf is not None else None
                rw = topk_weights[src] if topk_weights is not None else None
                rti = topk_idx[src]
                psum_e = torch.cumsum(torch.bincount(topk_idx[valid].long(), minlength=num_experts), 0).int()
                num_expanded = 0
            else:
                rows, weights, psum, pos = [], [], [], 0
                for e in range(num_experts):
                    pos = -(-pos // expert_alignment) * expert_alignment if pos else 0
                    for j, t in enumerate(src.tolist()):
                        for k in range(K):
                            if int(topk_idx[t, k]) == e:
                                rows.append(t)
                                weights.append(float(topk_weights[t, k]) if topk_weights is not None else 0.0)
                                meta[j, 2 + k] = pos
                                pos += 1
                    psum.append(pos)
                n = pos if do_cpu_sync else max(pos, num_max_tokens_per_rank * K)
                rx = torch.zeros((n, x.size(1)), dtype=x.dtype)
                rx[:pos] = x[rows] if rows else rx[:0]
                rsf = None
                if sf is not None:
                    rsf = torch.zeros((n, sf.size(1)), dtype=sf.dtype)
                    rsf[:pos] = sf[rows] if rows else rsf[:0]
                rw = torch.zeros((n,), dtype=torch.float)
                rw[:pos] = torch.tensor(weights)
                rti = None
                psum_e = torch.tensor(psum, dtype=torch.int32)
                num_expanded = pos
            if handle is None:
                handle = EPHandle()
                handle.do_expand, handle.num_experts, handle.expert_alignment = do_expand, num_experts, expert_alignment
                handle.num_max_tokens_per_rank, handle.num_sms = num_max_tokens_per_rank, num_sms
                handle.topk_idx = topk_idx.clone() if do_handle_copy else topk_idx
                handle.num_recv_tokens, handle.num_expanded_tokens = src.numel(), num_expanded
                handle.psum_num_recv_tokens_per_scaleup_rank = torch.tensor([src.numel()], dtype=torch.int32)
                handle.psum_num_recv_tokens_per_expert = psum_e
                handle.num_unaligned_recv_tokens_per_expert = (
                    torch.bincount(topk_idx[valid].long(), minlength=num_experts).int() if do_expand else None)
                handle.recv_src_metadata = meta
            ev = EventOverlap(object() if async_with_compute_stream else None)
            return ((rx, rsf) if rsf is not None else rx), rti, rw, handle, ev

        def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                    previous_event_before_epilogue=None, async_with_compute_stream=False,
                    allocate_on_comm_stream=False):
            assert x.dtype == torch.bfloat16
            T = handle.topk_idx.size(0)
            out = torch.zeros((T, x.size(1)), dtype=torch.float)
            meta = handle.recv_src_metadata
            for j in range(meta.size(0)):
                t = int(meta[j, 0])
                if handle.do_expand:
                    for s in meta[j, 2:].tolist():
                        if s >= 0:
                            out[t] += x[s].float()
                else:
                    out[t] += x[j].float()
            return out.to(torch.bfloat16), None, EventOverlap(object() if async_with_compute_stream else None)
''')


FAKE_V1 = '"""Stand-in for DeepEP V1 (no ElasticBuffer)."""\nimport torch\ntopk_idx_t = torch.int64\n'

TINY = ["--spawn", "--device", "cpu", "--nprocs", "1", "--tokens", "64", "--hidden", "256", "--topk", "4",
        "--experts", "16", "--sms", "4", "--ll-tokens", "16", "--ll-experts", "16", "--warmup", "0", "--iters", "1",
        "--host-iters", "2", "--no-plots", "--quiet"]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Folders holding a stand-in V2 and a stand-in V1, each as the package `deep_ep`."""
    root = tmp_path_factory.mktemp("fake-deep-ep-v2")
    for name, text in (("v2", FAKE_V2), ("v1", FAKE_V1)):
        (root / name / "deep_ep").mkdir(parents=True)
        (root / name / "deep_ep" / "__init__.py").write_text(text)
    return root


@pytest.fixture(scope="module")
def v2_report(group, stand_ins, tmp_path_factory):
    if group.rank() != 0:
        pytest.skip("not collective: runs on rank 0 only")
    out = tmp_path_factory.mktemp("bench-deepep-v2")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYEP_BACKEND", "cpu")
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.setenv(deepep_runner.ENV_ON_CPU, "1")
    mp.setenv(deepep_v2_runner.ENV_SRC, str(stand_ins / "v2"))
    try:
        report = bench.main(TINY + ["--impls", "pyep,deepep_v2", "--out", str(out)])
    finally:
        mp.undo()
    assert json.loads((out / "results.json").read_text()) == report
    return report, (out / "table.txt").read_text()


def test_import_keeps_v1(stand_ins, monkeypatch):
    """V2's package is also `deep_ep`: once imported it lives under deep_ep_v2, and a V1 imported before stays
    `deep_ep` (the `deepep` column of the same run)."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "deep_ep" or k.startswith("deep_ep.")}
    saved_v2 = sys.modules.pop(deepep_v2_runner.ALIAS, None)
    monkeypatch.syspath_prepend(str(stand_ins / "v1"))
    monkeypatch.setenv(deepep_v2_runner.ENV_SRC, str(stand_ins / "v2"))
    try:
        import deep_ep as v1
        mod, info = deepep_v2_runner._import_deepep_v2()
        assert mod is not None and info["skipped"] is None, info
        assert hasattr(mod, "ElasticBuffer") and not hasattr(v1, "ElasticBuffer")
        assert sys.modules["deep_ep"] is v1 and sys.modules[deepep_v2_runner.ALIAS] is mod
        assert str(stand_ins / "v2") not in sys.path
        # Not V2: a `deep_ep` without ElasticBuffer is refused with the variable to set.
        del sys.modules[deepep_v2_runner.ALIAS]
        monkeypatch.setenv(deepep_v2_runner.ENV_SRC, str(stand_ins / "v1"))
        mod, info = deepep_v2_runner._import_deepep_v2()
        assert mod is None and "no ElasticBuffer" in info["skipped"] and deepep_v2_runner.ENV_SRC in info["skipped"]
        assert sys.modules["deep_ep"] is v1
    finally:
        for k in [k for k in sys.modules if k == "deep_ep" or k.startswith("deep_ep")]:
            del sys.modules[k]
        sys.modules.update(saved)
        if saved_v2 is not None:
            sys.modules[deepep_v2_runner.ALIAS] = saved_v2


def test_why_not():
    assert "CUDA" in deepep_v2_runner.why_not(False, False, 2, 0)
    assert "one GPU per rank" in deepep_v2_runner.why_not(True, True, 2, 1)
    assert deepep_v2_runner.why_not(True, False, 2, 2) is None


def test_bench_v2_rows(v2_report):
    """V2's normal-mode rows: every op but layout, checked against the routing in prepare, the same received rows and
    bytes as pyep's, no Config and no chunk sizes, the case's SMs; the environment says which V2 ran."""
    report, table = v2_report
    assert "deepep_v2" not in report["skipped"], report["skipped"]
    assert report["env"]["deep_ep_v2"]["skipped"] is None and report["env"]["deep_ep_v2"]["version"] == "stand-in"
    by = {(r["impl"], r["op"]): r for r in report["results"]}
    assert ("deepep_v2", "layout") not in by
    for op in deepep_v2_runner.OPS:
        v, p = by[("deepep_v2", op)], by[("pyep", op)]
        assert v["error"] is None, (op, v["error"])
        assert v["config"] is None and v["nvl_send"] is None and v["nvl_recv"] is None and v["num_sms"] == 4
        for vr, pr in zip(v["per_rank"], p["per_rank"]):
            assert vr["recv_tokens"] == pr["recv_tokens"] and vr["bytes"] == pr["bytes"] > 0, op
            assert vr["launch_us"] is None and 0 < vr["host_us"] <= vr["result_us"]
    assert any(n.startswith("deepep_v2: DeepEP V2 stand-in ElasticBuffer") for n in report["plan"]["notes"])
    assert "deepep_v2 dispatch_bf16" in " ".join(table.split())


def test_bench_v2_low_latency(v2_report):
    """V2's low-latency rows (its decode path: no CPU sync, expanded layout): checked per expert and combined, the
    bytes of pyep's rows, no send/recv phases (V2 has no receive hook)."""
    report, _ = v2_report
    ll = {(r["impl"], r["op"]): r for r in report["results"] if r["op"] in bench.LL_OPS}
    for op in bench.LL_OPS:
        v, p = ll[("deepep_v2", op)], ll[("pyep", op)]
        assert v["error"] is None, (op, v["error"])
        assert 0 <= v["combine_err_max"] < 0.08
        for vr, pr in zip(v["per_rank"], p["per_rank"]):
            assert vr["bytes"] == pr["bytes"] > 0 and vr["send_us"] is None


def test_default_impls_leave_v2_out():
    from pyep.bench.plan import DEFAULT_IMPLS, IMPLS
    assert "deepep_v2" in IMPLS and "deepep_v2" not in DEFAULT_IMPLS


def test_nccl_loaded_is_the_mapped_library():
    """env.nccl_loaded: the NCCL this process runs (a deepep_v2 run preloads another than torch was built with)."""
    import re
    from pyep.bench.env import _nccl_loaded
    v = _nccl_loaded()
    if v is None:
        print("\ntest_nccl_loaded_is_the_mapped_library: no libnccl mapped in this process (torch without NCCL)")
        return
    assert re.fullmatch(r"\d+\.\d+\.\d+ \(.*libnccl\.so.*\)", v), v
