"""
pyep's benchmark: `python -m pyep.bench` measures normal-mode get_dispatch_layout, dispatch (BF16, FP8,
cached) and combine over a sweep of shapes and Configs, next to the all-to-all a user would write without
an EP library (the "baseline") and, where `import deep_ep` works, DeepEP itself; and low-latency mode (FP8
low_latency_dispatch, BF16 low_latency_combine, both back to back, with the hooked send and receive phases) for
pyep and DeepEP.

Launch:
    python -m pyep.bench --quick                    # spawns one rank per GPU (or 4 ranks on the cpu backend)
    python -m pyep.bench --nprocs 2 --tokens 256    # cpu: 2 ranks
    torchrun --nproc-per-node 8 -m pyep.bench       # each rank a torchrun process

With GPUs every rank takes its GPU (`torch.cuda.set_device(local_rank)`) in an NCCL group (the cuda
backend); where ranks outnumber GPUs they share them (GPU local_rank % count, a gloo group, PYEP_BACKEND=cuda;
figures for correctness, not speed); without GPUs, a gloo group and CPU tensors (the cpu backend). See
bench/README.md for the metrics, flags and outputs, and `python -m pyep.bench --help`.

In code: `main(argv)` (returns the report on rank 0 or in the launching process, None elsewhere), or
`run(args, group)` inside a process group that already exists (args from `parse_args`).

Modules: plan (command line, cases), inputs (routing, data), timing, ep_runner (the driver of DeepEP V1's
Buffer API), ll_runner (its low-latency API, with the correctness check), pyep_runner, deepep_runner, baseline, gpus (ranks on GPUs, MPS), env, sweep (the run), report
(merge, table, JSON, tuning), plots, launch.
"""
from .launch import main
from .plan import (BASELINE_OPS, FABRIC_OPS, FP8_FACTOR, IMPLS, LL_OPS, LL_REFERENCE, OPS, REFERENCE, TUNE_KINDS, Case,
                   LLCase, Plan, build_parser, make_plan, parse_args)
from .report import SCHEMA, replot, tune_table
from .sweep import run

__all__ = ["main", "run", "parse_args", "build_parser", "make_plan", "replot", "tune_table", "Case", "Plan",
           "SCHEMA", "OPS", "FABRIC_OPS", "BASELINE_OPS", "IMPLS", "FP8_FACTOR", "TUNE_KINDS", "REFERENCE", "LL_OPS",
           "LL_REFERENCE", "LLCase"]
