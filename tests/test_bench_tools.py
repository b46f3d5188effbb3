"""bench's tools beside pyep.bench: `bench/hostpath.py` (a call's host time, split at the core's entry) and
`bench/device/ll_chain.py --traces`, which lays the low-latency kernels of DeepEP's harness (chrome traces, a rank
each) side by side. Each runs in a subprocess of its own, local to each process: no group, no GPU."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LL_CHAIN = os.path.join(ROOT, "bench", "device", "ll_chain.py")
HOSTPATH = os.path.join(ROOT, "bench", "hostpath.py")


def write_trace(path: str, first_us: float, dispatch_us: float, name: str) -> None:
    """30 dispatch + combine pairs, the first dispatch first_us long, the others dispatch_us, each combine 25 µs,
    after an all_reduce kernel; a runtime call named like a kernel, which the reader must leave out."""
    events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 0.0, "dur": 6.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "dispatch launch", "ts": 1.0, "dur": 3.0}]
    t = 10.0
    for i in range(30):
        d = first_us if i == 0 else dispatch_us
        events.append({"ph": "X", "cat": "kernel", "name": f"void {name}::dispatch<8>(params)", "ts": t, "dur": d})
        t += d + 1.0
        events.append({"ph": "X", "cat": "kernel", "name": f"void {name}::combine<8>(params)", "ts": t, "dur": 25.0})
        t += 26.0
    with open(path, "w") as f:
        json.dump({"baseTimeNanoseconds": 1_000_000_000, "traceEvents": events}, f)


def read(paths: list) -> str:
    got = subprocess.run([sys.executable, LL_CHAIN, "--traces", *paths], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_ll_chain_reads_the_harness_traces(tmp_path):
    a, b = str(tmp_path / "rank0.json"), str(tmp_path / "rank1.json")
    write_trace(a, 120.0, 20.0, "deep_ep::internode_ll")
    write_trace(b, 110.0, 19.0, "deep_ep::internode_ll")
    out = read([a, b])
    assert "2 ranks, 1 reps of 30 dispatch + combine pairs" in out
    dispatch, combine = out.split("\ncombine:")
    # The harness's figure is the mean over all 30 calls, the first included: (120 + 29 * 20) / 30 and
    # (110 + 29 * 19) / 30; the first call is shown apart, the median of the others is theirs.
    assert "rank 0 23.33, rank 1 22.03 µs; the first of a rep: rank 0 120.0, rank 1 110.0 µs" in dispatch
    rows = [line.split() for line in dispatch.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "20.00", "20.00"), ("1", "19.00", "19.00")]
    assert "rank 0 25.00, rank 1 25.00 µs" in combine


def test_ll_chain_reads_pyep_kernels_and_refuses_a_short_trace(tmp_path):
    a, b = str(tmp_path / "rank0.json"), str(tmp_path / "rank1.json")
    write_trace(a, 20.0, 20.0, "pyep::ll")
    with open(a) as f:
        trace = json.load(f)
    trace["traceEvents"] = trace["traceEvents"][:-2]  # rank 1 saw a pair less
    with open(b, "w") as f:
        json.dump(trace, f)
    out = read([a, a])
    assert "rank 0 20.00, rank 1 20.00 µs" in out
    out = read([a, b])
    assert "rank 1: 58 low-latency kernels seen, expected 60: no table" in out


def test_hostpath_times_the_low_latency_calls(tmp_path):
    out = str(tmp_path / "hostpath.json")
    env = dict(os.environ, PYEP_BACKEND="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # the cpu path
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # its own group of one
        env.pop(k, None)
    got = subprocess.run([sys.executable, HOSTPATH, "--ll", "--ll-tokens", "8", "--hidden", "256", "--topk", "4",
                          "--ll-experts", "8", "--iters", "3", "--warmup", "1", "--json", out],
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert got.returncode == 0, got.stdout + got.stderr
    with open(out) as f:
        report = json.load(f)
    assert report["low_latency"] and (report["tokens"], report["hidden"], report["experts"]) == (8, 256, 8)
    calls = ["ll_dispatch_fp8", "ll_dispatch_bf16", "ll_combine", "ll_dispatch_send", "ll_dispatch_hook"]
    assert list(report["median_us"]) == calls
    for name in calls:
        samples = report["samples_us"][name]
        # The core stamps each low-latency export's entry: Python's part ends there, inside the call.
        assert len(samples["python"]) == 3 and all(0 < p <= r for p, r in zip(samples["python"], samples["return"]))


STAMPED_LL = r"""
import sys, tempfile
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import call_stamps
import pyep
methods = ("low_latency_dispatch", "low_latency_combine")
names = {m: call_stamps.stamped(m) for m in methods}
for m in methods:  # every mark still names a line of the method
    assert names[m] == ["entry"] + call_stamps.MARKS[m], (m, names[m])
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0, world_size=1)
M, H, K, E = 8, 256, 4, 8
buf = pyep.Buffer(dist.group.WORLD, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E),
                  low_latency_mode=True, num_qps_per_rank=E)
g = torch.Generator().manual_seed(0)
x = torch.randn(M, H, generator=g).to(torch.bfloat16)
topk = torch.rand(M, E, generator=g).topk(K, dim=1).indices
w = torch.rand(M, K, generator=g)
for i in range(3):
    call_stamps.STAMPS.clear()
    (rows, scales), count, handle, _, _ = buf.low_latency_dispatch(x, topk, M, E)
    assert len(call_stamps.STAMPS) == len(names["low_latency_dispatch"]), call_stamps.STAMPS
    assert call_stamps.STAMPS == sorted(call_stamps.STAMPS)
    assert int(count.sum()) == int((topk >= 0).sum())  # one rank: every selection arrives
    call_stamps.STAMPS.clear()
    y = (rows.float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)  # the experts: identity
    out, _, _ = buf.low_latency_combine(y, topk, w, handle)
    assert len(call_stamps.STAMPS) == len(names["low_latency_combine"]), call_stamps.STAMPS
    want = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.allclose(out.float(), want.float(), rtol=0.1, atol=0.1), (out - want).abs().max()
dist.destroy_process_group()
print("ok")
"""


def test_call_stamps_split_the_low_latency_calls(tmp_path):
    # bench/device/call_stamps.py's stamped copies of the low-latency methods: every mark found, one stamp each, and
    # the calls still right (on the cpu backend; the tool times them on a GPU).
    env = dict(os.environ, PYEP_BACKEND="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    got = subprocess.run([sys.executable, "-c", STAMPED_LL, os.path.join(ROOT, "bench", "device")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert got.returncode == 0 and "ok" in got.stdout, got.stdout + got.stderr
