"""DeepEP's tests/test_low_latency.py, its test_loop unmodified, with bench_kineto keeping each profiled loop's trace
(torch's chrome trace, every kernel on the host's clock): what its printed averages are made of. Run it in a copy of
DeepEP's tests/ (as bench/deepep/run_deepep_test.sh makes), with pyep as deep_ep, then read the traces of the unhooked
loop with bench/device/ll_chain.py --traces:

    cd COPY && PYTHONPATH=PYEP/bench/deepep python3 PYEP/bench/device/deepep_ll_trace.py --num-processes 2 --out DIR
    python3 PYEP/bench/device/ll_chain.py --traces DIR/harness-rank*-1.json

harness-rank<r>-1.json is rank r's profiled loop of unhooked calls (the printed dispatch and combine figures); the
hooked loop exports its own trace (to split its periods) and is not kept. A diagnosis only: the figures the README
reports come from the unmodified test.
"""
import argparse
import os
import sys

import torch


def loop(local_rank: int, num_processes: int, args: argparse.Namespace, out: str) -> None:
    sys.path.insert(0, os.getcwd())
    import test_low_latency as t
    bench_kineto, calls = t.bench_kineto, [0]

    def traced(*a, **k):
        calls[0] += 1
        # The hooked loop (two kernels a period) exports its own trace to split the periods, and a profile's
        # trace can be exported once: that loop keeps its own.
        if k.get("num_kernels_per_period", 1) == 1:
            k["trace_path"] = os.path.join(out, f"harness-rank{local_rank}-{calls[0]}.json")
        return bench_kineto(*a, **k)

    t.bench_kineto = traced
    t.test_loop(local_rank, num_processes, args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    # DeepEP's defaults (test_low_latency.py's parser), the shape the README's figures use.
    args = argparse.Namespace(num_processes=a.num_processes, num_tokens=128, hidden=7168, num_topk=8, num_experts=288,
                              allow_mnnvl=False, disable_nvlink=False, use_logfmt=False, pressure_test=False,
                              shrink_test=False)
    torch.multiprocessing.spawn(loop, args=(a.num_processes, args, os.path.abspath(a.out)), nprocs=a.num_processes)
