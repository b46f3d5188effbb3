"""`python -m pyep.bench` and pyep.tuning.

The bench test spawns its own two-rank gloo group (its rendezvous store on a port the OS picks), so it runs on
rank 0 of the torchrun launch only; the other tests are local to each process."""
import json
import os
import tempfile
import warnings

import pytest

import pyep
from pyep import bench, tuning

TINY = ["--spawn", "--device", "cpu", "--nprocs", "2", "--tokens", "64", "--hidden", "256", "--topk", "4",
        "--experts", "8", "--sms", "4", "--ll-tokens", "16", "--ll-experts", "8", "--warmup", "0", "--iters", "1",
        "--host-iters", "1", "--no-plots", "--quiet"]


@pytest.fixture(scope="module")
def tiny_report(group):
    if group.rank() != 0:
        pytest.skip("not collective: runs on rank 0 only")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYEP_BACKEND", "cpu")
    mp.setenv("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="pyep-bench-test-") as out:
        try:
            report = bench.main(TINY + ["--out", out])
            with open(os.path.join(out, "results.json")) as f:
                on_disk = json.load(f)
            table = open(os.path.join(out, "table.txt")).read()
        finally:
            mp.undo()
        yield report, on_disk, table


def test_bench_json(tiny_report):
    report, on_disk, table = tiny_report
    assert on_disk == report
    assert report["schema"] == bench.SCHEMA
    env = report["env"]
    for key in ("hostname", "date", "torch", "pyep", "gpu", "driver", "cuda", "nccl", "deep_ep", "num_ranks", "backend",
                "gpu_sharing", "mps"):
        assert key in env, key
    assert env["backend"] == "cpu" and env["num_ranks"] == 2 and env["pyep"] == pyep.__version__
    assert "deepep" in report["skipped"] and env["deep_ep"]["skipped"]
    assert report["plan"]["mode"] == "sweep" and report["plan"]["num_cases"] == 1
    assert report["plots"] == [] and report["plots_skipped"] == "--no-plots"

    assert report["plan"]["num_ll_cases"] == 1 and report["plan"]["ll_reference"] == {"tokens": 16, "hidden": 256,
                                                                                        "topk": 4, "experts": 8}
    results = {(r["impl"], r["op"]): r for r in report["results"]}
    expected = ({("pyep", op) for op in bench.OPS + bench.LL_OPS} | {("baseline", op) for op in bench.BASELINE_OPS})
    assert set(results) == expected
    for (impl, op), r in results.items():
        if op in bench.LL_OPS:
            continue  # test_bench_low_latency_rows
        assert r["error"] is None, (impl, op, r["error"])
        assert (r["tokens"], r["hidden"], r["topk"], r["experts"]) == (64, 256, 4, 8)
        assert len(r["per_rank"]) == 2
        assert 0 < r["time_us_min"] <= r["time_us_avg"] <= r["time_us_max"]
        for p in r["per_rank"]:
            assert len(p["times_us"]) == 1 and p["min_us"] == p["median_us"] == p["max_us"] > 0
            assert 0 < p["host_us"] <= p["result_us"]  # the result is ready once the call returns on cpu
            assert p["launch_us"] is None  # the cpu backend launches no kernels
            if op == "layout":  # no bytes; pyep's layout is measured without a dispatch, so without recv_tokens
                assert p["bytes"] == 0 and p["gbps"] is None
                continue
            assert 0 < p["recv_tokens"] <= 2 * 64
            factor = bench.FP8_FACTOR if op == "dispatch_fp8" else 1
            assert p["bytes"] == int(p["recv_tokens"] * 256 * 2 * factor)
            assert p["gbps"] == pytest.approx(p["bytes"] / 1e9 / (p["median_us"] / 1e6), rel=1e-2, abs=1e-3)
        assert r["result_us_avg"] >= r["host_us_avg"] > 0 and r["launch_us_avg"] is None
        if op == "layout":
            assert r["gbps_avg"] is None and r["num_sms"] is None
        else:
            assert 0 < r["gbps_min"] <= r["gbps_avg"]
        if impl == "pyep" and op != "layout":
            assert r["config"][0] == 4 and r["num_sms"] == 4
        if impl == "baseline":
            assert r["config"] is None and r["num_sms"] is None
    # Both receive the same tokens: the same routing, one copy per destination rank.
    for rk in range(2):
        assert (results[("pyep", "dispatch_bf16")]["per_rank"][rk]["recv_tokens"]
                == results[("baseline", "dispatch_bf16")]["per_rank"][rk]["recv_tokens"])
    assert "dispatch_bf16" in table and "baseline" in table and "result" in table


def test_bench_low_latency_rows(tiny_report):
    """The low-latency rows: pyep's own low-latency Buffer, checked, timed, counted in DeepEP's low-latency bytes."""
    report, _, table = tiny_report
    rows = {r["op"]: r for r in report["results"] if r["op"] in bench.LL_OPS}
    assert set(rows) == set(bench.LL_OPS) and all(r["impl"] == "pyep" for r in rows.values())
    selections = 16 * 4  # no masked top-k entries: every token selects 4 experts
    per_selection = {"ll_dispatch": 256 + 256 // 128 * 4 + 16, "ll_combine": 256 * 2}
    per_selection["ll_dispatch_combine"] = per_selection["ll_dispatch"] + per_selection["ll_combine"]
    for op, r in rows.items():
        assert r["error"] is None, (op, r["error"])
        assert (r["tokens"], r["hidden"], r["topk"], r["experts"]) == (16, 256, 4, 8)
        assert r["num_sms"] is None and r["config"] is None and r["nvl_send"] is None
        assert r["ranks_per_node"] == 0 and r["num_nodes"] == 1  # one node: PYEP_RANKS_PER_NODE unset
        assert 0 <= r["combine_err_max"] < 0.08  # the check ran and passed (FP8 rounding only)
        # Every (token, expert) pair reaches its expert: 2 ranks x 16 tokens x 4 choices in all.
        assert sum(p["recv_tokens"] for p in r["per_rank"]) == 2 * selections
        for p in r["per_rank"]:
            assert p["bytes"] == selections * per_selection[op]
            assert p["gbps"] == pytest.approx(p["bytes"] / 1e9 / (p["median_us"] / 1e6), rel=1e-2, abs=1e-3)
            assert 0 < p["host_us"] <= p["result_us"] and p["launch_us"] is None
            assert p["min_us"] == p["median_us"] > 0
            if op == "ll_dispatch_combine":
                assert p["send_us"] is None and p["recv_us"] is None
            else:  # the hooked call's two phases
                assert p["send_us"] > 0 and p["recv_us"] > 0
        assert r["bytes_total"] == 2 * selections * per_selection[op]
        assert (r["send_us_avg"] is None) == (op == "ll_dispatch_combine")
    # The normal rows keep their shape: no low-latency field.
    normal = next(r for r in report["results"] if r["op"] == "dispatch_bf16")
    assert "send_us_avg" not in normal and "send_us" not in normal["per_rank"][0]
    assert "ll_dispatch_combine" in table and "send" in table and "low latency" in table


def test_bench_low_latency_only(tmp_path, group):
    """--ll: the low-latency ops alone, no normal-mode case (nor Buffer); a Buffer that low latency cannot use."""
    if group.rank() != 0:
        pytest.skip("not collective: runs on rank 0 only")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYEP_BACKEND", "cpu")
    mp.setenv("OMP_NUM_THREADS", "1")
    try:
        # hidden 200 is no multiple of 128: low-latency dispatch refuses it, an error row, no figures.
        report = bench.main(TINY + ["--ll", "--hidden", "256,200", "--out", str(tmp_path)])
    finally:
        mp.undo()
    assert report["plan"]["num_cases"] == 0 and report["plan"]["ops"] == list(bench.LL_OPS)
    by = {(r["op"], r["hidden"]): r for r in report["results"]}
    assert set(by) == {(op, h) for op in bench.LL_OPS for h in (256, 200)}
    for op in bench.LL_OPS:
        assert by[(op, 256)]["error"] is None and by[(op, 256)]["time_us_avg"] > 0
        bad = by[(op, 200)]
        assert bad["error"] and "prepare" in bad["error"] and "hidden" in bad["error"], bad["error"]
        assert "time_us_avg" not in bad


def _check_node_rows(report, R, ks, per_rank_tokens=16, topk=4):
    """The low-latency rows of a run with --ll-nodes: one-node rows (ranks_per_node 0) and, for each k in ks, pyep's
    rows on R / k emulated nodes, all checked by the bench (combine_err) and receiving every (token, expert) pair."""
    rows = {}
    for r in report["results"]:
        assert r["op"] in bench.LL_OPS
        rows[(r["impl"], r["ranks_per_node"], r["op"])] = r
    assert set(rows) == {("pyep", k, op) for k in [0] + list(ks) for op in bench.LL_OPS}
    for (impl, k, op), r in rows.items():
        assert r["error"] is None, (k, op, r["error"])
        assert r["num_nodes"] == (R // k if k else 1)
        assert 0 <= r["combine_err_max"] < 0.08  # the bench's own check ran and passed
        assert sum(p["recv_tokens"] for p in r["per_rank"]) == R * per_rank_tokens * topk
        one = rows[(impl, 0, op)]
        assert [p["bytes"] for p in r["per_rank"]] == [p["bytes"] for p in one["per_rank"]]
        assert [p["recv_tokens"] for p in r["per_rank"]] == [p["recv_tokens"] for p in one["per_rank"]]
    return rows


@pytest.mark.parametrize("nprocs,two_sets", [(2, True), (4, False)])
def test_bench_ll_nodes(tmp_path, group, nprocs, two_sets):
    """--ll-nodes: pyep's low-latency rows once more per node size k on a Buffer made with PYEP_RANKS_PER_NODE=k (set
    around its construction only), beside the one-node rows; sizes that do not fit are skipped with the reason. On cpu
    in the launcher's one set of processes; with PYEP_BENCH_NODES_APART=1 (what the cuda backend always does) in a
    second set after the first, merged into the same report, table and output as if one run."""
    if group.rank() != 0:
        pytest.skip("not collective: runs on rank 0 only")
    from conftest import record_spawned_sets
    from pyep.bench import sweep
    mp = pytest.MonkeyPatch()
    mp.setenv("PYEP_BACKEND", "cpu")
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.delenv("PYEP_RANKS_PER_NODE", raising=False)
    if two_sets:
        mp.setenv(sweep.NODES_APART_ENV, "1")
    else:
        mp.delenv(sweep.NODES_APART_ENV, raising=False)
    sets = record_spawned_sets(mp)
    argv = list(TINY)
    argv[argv.index("--nprocs") + 1] = str(nprocs)
    try:
        report = bench.main(argv + ["--ll", "--ll-nodes", "1,2,3", "--out", str(tmp_path)])
        assert "PYEP_RANKS_PER_NODE" not in os.environ
    finally:
        mp.undo()
    assert sets == ([sweep.FIRST, sweep.NODES] if two_sets else [None])
    assert json.loads((tmp_path / "results.json").read_text()) == report
    fits = [k for k in (1, 2, 3) if k < nprocs and nprocs % k == 0]
    assert report["schema"] == "pyep-bench/4" and report["plan"]["ll_nodes"] == fits
    skipped = {k: report["skipped"].get(f"pyep low-latency ranks_per_node={k}") for k in (1, 2, 3)}
    for k, why in skipped.items():
        if k in fits:
            assert why is None, (k, why)
        elif k >= nprocs:
            assert why and "one node" in why, (k, why)
        else:
            assert why and "does not divide" in why, (k, why)
    rows = _check_node_rows(report, nprocs, fits)
    assert report["env"]["num_ranks"] == nprocs and rows
    # One run's output: one header, the one-node rows, then each size's rows, and the report written last.
    table = (tmp_path / "table.txt").read_text().splitlines()
    assert sum("low latency (" in line for line in table) == 1
    order = [w[1] for w in map(str.split, table) if len(w) > 2 and w[0] == "pyep" and w[2] in bench.LL_OPS]
    assert order == ["-"] * 3 + [f"{nprocs // k}x{k}" for k in fits for _ in range(3)]
    assert sum("ranks_per_node=3" in line for line in table) == 1  # the skip is said in the output too, once
    assert table[-1].startswith("wrote ") and sum(line.startswith("wrote ") for line in table) == 1
    assert any("second set of" in n for n in report["plan"]["notes"]) == two_sets


def test_bench_ll_nodes_in_group(tmp_path, group, monkeypatch):
    """--ll-nodes in the launch's own group (every rank runs the bench): after the run no rank has
    PYEP_RANKS_PER_NODE set. On the cuda backend low-latency mode across nodes is not available yet: the emulated
    rows are the cases' error rows, naming NotAvailableError; on cpu they pass the bench's check."""
    from conftest import BACKEND, DEVICE
    R = group.size()
    ks = [k for k in (1, 2) if k < R and R % k == 0]
    if not ks:
        print(f"\ntest_bench_ll_nodes_in_group: {R} rank(s): no node size of 1 or 2 makes several nodes", flush=True)
        pytest.skip(f"{R} rank(s): no node size of 1 or 2 makes several nodes")
    monkeypatch.delenv("PYEP_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = bench.parse_args(TINY[TINY.index("--tokens"):] + ["--device", DEVICE, "--ll", "--impls", "pyep",
                                                             "--ll-nodes", ",".join(map(str, ks + [R])),
                                                             "--out", str(tmp_path)])
    report = bench.run(args, group)
    assert "PYEP_RANKS_PER_NODE" not in os.environ
    if group.rank() != 0:
        return
    assert report["plan"]["ll_nodes"] == ks and "one node" in report["skipped"][f"pyep low-latency ranks_per_node={R}"]
    if BACKEND == "cpu":
        _check_node_rows(report, R, ks)
        return
    for r in report["results"]:
        if r["ranks_per_node"]:
            # Across nodes on cuda: NVSHMEM's rows, or error rows that say why NVSHMEM cannot run here.
            assert r["error"] is None or "NotAvailableError" in r["error"] and "NVSHMEM" in r["error"], r["error"]
        else:
            assert r["error"] is None, r["error"]


def test_bench_ll_nodes_not_available(tmp_path, group, monkeypatch):
    """A backend that refuses low-latency mode across nodes (the cuda backend where NVSHMEM cannot run; a stand-in here on cpu,
    in the launch's group): the emulated rows are error rows with the message, the one-node rows run, nothing crashes."""
    from conftest import BACKEND, DEVICE
    R = group.size()
    if BACKEND != "cpu" or R < 2:
        why = "the cuda backend refuses for real (test_bench_ll_nodes_in_group)" if BACKEND != "cpu" else "one rank"
        print(f"\ntest_bench_ll_nodes_not_available: skipped: {why}", flush=True)
        pytest.skip(why)
    clean = pyep.Buffer.clean_low_latency_buffer

    def refuse(self, *a, **kw):
        if self.runtime.get_num_rdma_ranks() > 1:
            raise pyep.NotAvailableError("Buffer.clean_low_latency_buffer: low-latency mode across nodes on the cuda "
                                         "backend needs NVSHMEM (a stand-in)")
        return clean(self, *a, **kw)

    monkeypatch.setattr(pyep.Buffer, "clean_low_latency_buffer", refuse)
    monkeypatch.delenv("PYEP_RANKS_PER_NODE", raising=False)
    args = bench.parse_args(TINY[TINY.index("--tokens"):] + ["--device", DEVICE, "--ll", "--impls", "pyep",
                                                             "--ll-nodes", "1", "--out", str(tmp_path)])
    report = bench.run(args, group)
    assert "PYEP_RANKS_PER_NODE" not in os.environ
    if group.rank() != 0:
        return
    assert len(report["results"]) == 2 * len(bench.LL_OPS)
    for r in report["results"]:
        if r["ranks_per_node"] == 1:
            assert r["error"].startswith("prepare: rank 0: NotAvailableError: Buffer.clean_low_latency_buffer"), r["error"]
        else:
            assert r["ranks_per_node"] == 0 and r["error"] is None, r["error"]


def test_bench_second_set_fails(tmp_path, monkeypatch):
    """The launcher's second set of processes (the emulated-node rows) failing: the report holds the first set's rows,
    and each --ll-nodes size is skipped with the failure; where the first set skipped them all (pyep did not run),
    no second set starts."""
    from torch.multiprocessing import ProcessRaisedException
    from pyep.bench import launch, report as report_mod, sweep
    args = bench.parse_args(TINY + ["--ll", "--ll-nodes", "1", "--out", str(tmp_path)])
    plan = bench.make_plan(args, "cpu", 2)
    row = {"impl": "pyep", "op": "ll_dispatch", "ranks_per_node": 0, "error": "prepare: rank 0: stand-in"}
    sets = []

    def spawn_set(nprocs, opts, part=None):
        sets.append(part)
        if part == sweep.FIRST:
            return report_mod.Part(plan=plan, env={"num_ranks": 2}, skipped=dict(first_skipped), results=[row],
                                   lines=["first set"], elapsed=1.0, out_dir=str(tmp_path), num_ranks=2, cuda=False,
                                   shared=False)
        raise ProcessRaisedException("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent "
                                     "call last):\n  File ...\nRuntimeError: stand-in\n", 1, 4321)

    monkeypatch.setattr(launch, "_spawn_set", spawn_set)
    first_skipped: dict = {}
    got = launch._spawn_two_sets(args, 2, dict(vars(args)))
    assert sets == [sweep.FIRST, sweep.NODES] and got["results"] == [row] and got["elapsed_s"] == 1.0
    assert got["skipped"] == {"pyep low-latency ranks_per_node=1":
                              "the second set of processes failed (rank 1: RuntimeError: stand-in)"}
    assert json.loads((tmp_path / "results.json").read_text()) == got
    table = (tmp_path / "table.txt").read_text().splitlines()
    assert table[0] == "first set" and table[1].startswith("skipped pyep low-latency ranks_per_node=1: the second set")
    sets.clear()
    first_skipped["pyep low-latency ranks_per_node=1"] = "pyep did not run"
    got = launch._spawn_two_sets(args, 2, dict(vars(args)))
    assert sets == [sweep.FIRST] and got["skipped"] == first_skipped


def test_ranks_per_node_env_is_restored(monkeypatch):
    from pyep.bench.ll_runner import ranks_per_node_env
    monkeypatch.delenv("PYEP_RANKS_PER_NODE", raising=False)
    with ranks_per_node_env(2):
        assert os.environ["PYEP_RANKS_PER_NODE"] == "2"
    assert "PYEP_RANKS_PER_NODE" not in os.environ
    monkeypatch.setenv("PYEP_RANKS_PER_NODE", "4")
    with pytest.raises(RuntimeError):
        with ranks_per_node_env(1):
            assert os.environ["PYEP_RANKS_PER_NODE"] == "1"
            raise RuntimeError("a Buffer that failed")
    assert os.environ["PYEP_RANKS_PER_NODE"] == "4"


def test_bench_ll_nodes_plan():
    plan = bench.make_plan(bench.parse_args(["--ll", "--ll-nodes", "1,2,3,8"]), "cuda", 8)
    assert plan.ll_nodes == [1, 2] and set(plan.ll_nodes_skipped) == {3, 8}
    assert "does not divide" in plan.ll_nodes_skipped[3] and "one node" in plan.ll_nodes_skipped[8]
    assert any("DeepEP has no emulated nodes" in n for n in plan.notes)
    assert bench.make_plan(bench.parse_args(["--ll"]), "cuda", 8).ll_nodes == []
    none = bench.make_plan(bench.parse_args(["--ops", "dispatch_bf16", "--ll-nodes", "2"]), "cuda", 8)
    assert none.ll_nodes == [] and any("--ll-nodes 2: no pyep low-latency rows" in n for n in none.notes)
    with pytest.raises(SystemExit):
        bench.parse_args(["--ll-nodes", "0"])


def test_bench_replot(tiny_report, tmp_path):
    """--replot draws a finished run's plots (from a GPU host without matplotlib) and records them in its report."""
    report = json.loads(json.dumps(tiny_report[0]))
    # A second point per line: the same measurements at twice the tokens.
    report["results"] += [dict(r, tokens=2 * r["tokens"]) for r in report["results"]]
    (tmp_path / "results.json").write_text(json.dumps(report))
    again = bench.main(["--replot", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == again
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert again["plots"] == [] and "matplotlib" in again["plots_skipped"]
        return
    # GB/s of the normal-mode ops, and µs of the low-latency ones (the tiny run has both).
    assert again["plots"] == ["gbps_vs_tokens.png", "ll_us_vs_tokens.png"] and again["plots_skipped"] is None
    for name in again["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_tuning_round_trip(tiny_report, monkeypatch):
    report = tiny_report[0]
    with tempfile.TemporaryDirectory(prefix="pyep-tuning-test-") as tmp:
        path = os.path.join(tmp, "tuning.json")
        monkeypatch.setenv(tuning.ENV_FILE, path)
        table = bench.tune_table(report["results"], 2, "cpu", 256)
        assert tuning.save(table) == path
        measured = {r["op"]: r["config"] for r in report["results"] if r["impl"] == "pyep"}
        assert tuning.load_tuned("dispatch", 2) == pyep.Config(*measured["dispatch_bf16"])
        assert tuning.load_tuned("dispatch_fp8", 2, num_sms=4) == pyep.Config(*measured["dispatch_fp8"])
        assert tuning.load_tuned("combine", 2, hidden=7168) == pyep.Config(*measured["combine_bf16"])
        assert tuning.load_tuned("dispatch", 4) is None
        assert tuning.load_tuned("dispatch", 2, num_sms=24) is None
        tuning.clear_cache()


def _table(hidden_best):
    """A tuning table from {(hidden, kind): {config: (us, gbps)}}."""
    return tuning.make_table(8, "Test GPU 80GB", hidden_best, default_hidden=7168, source={"tokens": [4096]})


def test_tuning_round_trip(monkeypatch):
    with tempfile.TemporaryDirectory(prefix="pyep-tuning-test-") as tmp:
        path = os.path.join(tmp, "t.json")
        monkeypatch.setenv(tuning.ENV_FILE, path)
        assert tuning.load_tuned("dispatch", 8) is None  # no file yet
        results = {
            (7168, "dispatch"): {(24, 6, 256, 6, 128): (300.0, 150.0), (24, 16, 256, 6, 128): (250.0, 180.0),
                                 (20, 8, 256, 6, 128): (280.0, 160.0)},
            (7168, "combine"): {(24, 4, 256, 6, 128): (320.0, 140.0), (20, 4, 256, 6, 128): (330.0, 136.0)},
            (2048, "dispatch"): {(24, 32, 512, 6, 128): (90.0, 120.0)},
        }
        assert tuning.save(_table(results)) == path
        assert tuning.load_tuned("dispatch", 8) == pyep.Config(24, 16, 256, 6, 128)
        assert tuning.load_tuned("dispatch", 8, num_sms=20) == pyep.Config(20, 8, 256, 6, 128)
        assert tuning.load_tuned("dispatch", 8, num_sms=12) is None
        assert tuning.load_tuned("combine", 8) == pyep.Config(24, 4, 256, 6, 128)
        assert tuning.load_tuned("combine", 8, hidden=7000) == pyep.Config(24, 4, 256, 6, 128)
        assert tuning.load_tuned("dispatch", 8, hidden=2048) == pyep.Config(24, 32, 512, 6, 128)
        assert tuning.load_tuned("dispatch", 8, hidden=3000) == pyep.Config(24, 32, 512, 6, 128)  # nearest
        assert tuning.load_tuned("combine", 8, hidden=2048) is None
        assert tuning.load_tuned("dispatch_fp8", 8) is None
        assert tuning.load_tuned("dispatch", 4) is None  # the file is for 8 ranks
        with pytest.raises(ValueError, match="kind"):
            tuning.load_tuned("dispatcher", 8)
        entry = tuning.lookup("dispatch", 8)
        assert entry == {"config": [24, 16, 256, 6, 128], "time_us": 250.0, "gbps": 180.0}
        assert tuning.load_tuned("dispatch", 8) is not tuning.load_tuned("dispatch", 8)  # fresh objects

        # A malformed file warns once and counts as missing.
        with open(path, "w") as f:
            f.write("{not json")
        tuning.clear_cache()
        with pytest.warns(RuntimeWarning, match="ignoring tuning file"):
            assert tuning.load_tuned("dispatch", 8) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tuning.load_tuned("dispatch", 8) is None
        tuning.clear_cache()


def test_tuning_default_path(monkeypatch):
    monkeypatch.delenv(tuning.ENV_FILE, raising=False)
    path = tuning.tuning_path(8, "NVIDIA H100 80GB HBM3")
    assert path == os.path.join(os.path.expanduser("~"), ".cache", "pyep", "tuning", "NVIDIA_H100_80GB_HBM3-8.json")
    monkeypatch.setenv(tuning.ENV_FILE, "/x/y.json")
    assert tuning.tuning_path(8, "cpu") == "/x/y.json"


def test_bench_lists_and_plan():
    assert bench.plan._int_list("128:1024:x2") == [128, 256, 512, 1024]
    assert bench.plan._int_list("8:24:4") == [8, 12, 16, 20, 24]
    assert bench.plan._int_list("2048,4096,2048") == [2048, 4096]
    assert bench.plan._chunk_list("default,4,8") == [None, 4, 8]
    args = bench.parse_args(["--tokens", "128,4096", "--hidden", "2048,7168", "--sms", "8,24", "--experts", "250"])
    plan = bench.make_plan(args, "cuda", 8)
    assert plan.reference == {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 248, "num_sms": 24,
                              "nvl_send": None, "nvl_recv": None}
    # tokens x hidden at 24 SMs, plus SMs x hidden at 4096 tokens: (4096, *, 24) is shared.
    assert len(plan.cases) == 4 + 4 - 2
    assert any("248" in n for n in plan.notes)
    quick = bench.make_plan(bench.parse_args(["--quick"]), "cuda", 8)
    assert [(c.tokens, c.hidden, c.topk, c.experts, c.num_sms) for c in quick.cases] == [(4096, 7168, 8, 256, 24)]
    full = bench.make_plan(bench.parse_args(["--full", "--tokens", "128,256", "--sms", "8,12,16"]), "cuda", 8)
    assert len(full.cases) == 2 * 3 * 3
    tune = bench.make_plan(bench.parse_args(["--tune"]), "cpu", 4)
    assert tune.impls == ["pyep"] and set(tune.ops) == set(bench.TUNE_KINDS) and tune.ll_cases == []


def test_bench_low_latency_plan():
    """--quick holds both reference cases; the low-latency lists; --ll; --ops with low-latency ops."""
    quick = bench.make_plan(bench.parse_args(["--quick"]), "cuda", 8)
    assert [(c.tokens, c.hidden, c.topk, c.experts) for c in quick.ll_cases] == [(128, 7168, 8, 288)]
    assert quick.ll_reference == bench.LL_REFERENCE and len(quick.cases) == 1
    assert set(bench.LL_OPS) <= set(quick.ops)
    cpu = bench.make_plan(bench.parse_args(["--quick"]), "cpu", 4)
    assert [(c.tokens, c.hidden, c.experts) for c in cpu.ll_cases] == [(128, 2048, 64)]
    assert any("low-latency rows" in n for n in cpu.notes)
    ll = bench.make_plan(bench.parse_args(["--quick", "--ll"]), "cuda", 8)
    assert ll.cases == [] and ll.ops == list(bench.LL_OPS) and len(ll.ll_cases) == 1
    # The default sweep: tokens x hidden around the reference, then top-k x experts (rounded to the ranks).
    sweep = bench.make_plan(bench.parse_args(["--ll-tokens", "64,128", "--hidden", "4096,7168", "--topk", "6,8",
                                              "--ll-experts", "250,288"]), "cuda", 8)
    cases = {(c.tokens, c.hidden, c.topk, c.experts) for c in sweep.ll_cases}
    assert cases == {(t, h, 8, 288) for t in (64, 128) for h in (4096, 7168)} | {(128, 7168, k, e) for k in (6, 8)
                                                                                 for e in (248, 288)}
    assert any("low-latency experts 250 -> 248" in n for n in sweep.notes)
    normal = bench.make_plan(bench.parse_args(["--ops", "dispatch_bf16"]), "cuda", 8)
    assert normal.ll_cases == [] and "ll_tokens" not in normal.lists
    only = bench.make_plan(bench.parse_args(["--ops", "ll_combine"]), "cpu", 2)
    assert only.cases == [] and only.ll_cases
    with pytest.raises(SystemExit):
        bench.parse_args(["--ll", "--ops", "layout"])
