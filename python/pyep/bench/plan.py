"""The sweep's plan: the command line, the presets, and the cases they make."""
import argparse
import itertools
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from .. import tuning

OPS = ("layout", "dispatch_bf16", "dispatch_fp8", "dispatch_cached", "combine_bf16")
# The NCCL all_to_all_single alone of a dispatch's BF16 rows, already in send order: what the fabric gives this
# traffic through NCCL, a reference for dispatch and combine rather than code a user would run.
FABRIC_OPS = ("alltoall_bf16",)
# Low-latency mode (a Buffer of its own, low_latency_mode=True): FP8 dispatch, BF16 combine, and the two back to back.
LL_OPS = ("ll_dispatch", "ll_combine", "ll_dispatch_combine")
IMPLS = ("pyep", "baseline", "deepep", "deepep_v2")
# What runs when --impls is not given: DeepEP V2 is asked for by name (it needs NCCL >= 2.30.4 in the process).
DEFAULT_IMPLS = ("pyep", "baseline", "deepep")
# The baseline has no cached dispatch: its split sizes are already known on the host.
BASELINE_OPS = ("layout", "dispatch_bf16", "dispatch_fp8", "combine_bf16") + FABRIC_OPS
# FP8 dispatch moves 1-byte elements plus one float32 scale per 128: DeepEP counts it as BF16 bytes times this.
FP8_FACTOR = (1 + 4 / 128) / 2
# Tuning: which measured op stands for which kind of a tuning file.
TUNE_KINDS = {"dispatch_bf16": "dispatch", "dispatch_fp8": "dispatch_fp8", "combine_bf16": "combine"}

# The reference case (DeepEP's tests/test_intranode.py): 4096 tokens a rank, hidden 7168, top-8 of 256, 24 SMs.
REFERENCE = {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "num_sms": 24}
# The low-latency reference case (DeepEP's tests/test_low_latency.py): 128 tokens a rank, hidden 7168, top-8 of 288.
LL_REFERENCE = {"tokens": 128, "hidden": 7168, "topk": 8, "experts": 288}

# Sweep lists of each preset and backend; None in the chunk lists: the op's recommended (get_*_config) value.
_SWEEPS = {
    ("quick", "cuda"): dict(tokens=[4096], hidden=[7168], topk=[8], experts=[256], sms=[24], nvl_send=[None], nvl_recv=[None]),
    # The cpu backend copies with goroutines; the reference 4096 x 7168 takes long, the quick case is smaller.
    ("quick", "cpu"): dict(tokens=[1024], hidden=[2048], topk=[8], experts=[256], sms=[24], nvl_send=[None], nvl_recv=[None]),
    ("sweep", "cuda"): dict(tokens=[128 << i for i in range(7)], hidden=[2048, 4096, 7168], topk=[8], experts=[256],
                            sms=[8, 12, 16, 20, 24], nvl_send=[None], nvl_recv=[None]),
    ("sweep", "cpu"): dict(tokens=[128 << i for i in range(5)], hidden=[2048, 4096, 7168], topk=[8], experts=[256],
                           sms=[8, 16, 24], nvl_send=[None], nvl_recv=[None]),
    ("tune", "cuda"): dict(tokens=[4096], hidden=[2048, 4096, 7168], topk=[8], experts=[256], sms=[8, 12, 16, 20, 24],
                           nvl_send=[None, 1, 2, 4, 6, 8, 12, 16, 24, 32], nvl_recv=[None]),
    ("tune", "cpu"): dict(tokens=[1024], hidden=[2048], topk=[8], experts=[256], sms=[8, 16, 24],
                          nvl_send=[None, 4, 8, 16, 32], nvl_recv=[None]),
}
# Low-latency lists (hidden and top-k are the normal lists'): tokens a rank (num_max_dispatch_tokens_per_rank) and
# experts. On cpu the buffer is shared memory: fewer experts keep it small (get_low_latency_rdma_size_hint grows with them).
_LL_SWEEPS = {
    ("quick", "cuda"): dict(ll_tokens=[128], ll_experts=[288]),
    ("quick", "cpu"): dict(ll_tokens=[128], ll_experts=[64]),
    ("sweep", "cuda"): dict(ll_tokens=[16, 32, 64, 128, 256], ll_experts=[288]),
    ("sweep", "cpu"): dict(ll_tokens=[32, 128], ll_experts=[64]),
}
_ITERS = {"cuda": dict(warmup=20, iters=50, host_iters=10), "cpu": dict(warmup=1, iters=5, host_iters=2)}
_NOTES = {("quick", "cpu"): "cpu backend: --quick uses 1024 tokens x hidden 2048 instead of the reference 4096 x 7168 "
                            "(pass --tokens/--hidden to change)",
          ("quick-ll", "cpu"): "cpu backend: low-latency rows at hidden 2048 and 64 experts instead of the reference 7168 and 288 "
                               "(pass --hidden/--ll-experts to change)"}


# ---- command line ------------------------------------------------------------------------------------------

def _int_list(text: str, allow_default: bool = False) -> List[Optional[int]]:
    """Parses "1,2,4", "8:24:4" (inclusive, step 4), "128:8192:x2" (doubling); "default" for None."""
    out: List[Optional[int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if allow_default and part in ("default", "auto", "none"):
            out.append(None)
        elif ":" in part:
            bits = part.split(":")
            if len(bits) not in (2, 3):
                raise argparse.ArgumentTypeError(f"{part!r}: expected START:STOP[:STEP] or START:STOP:xFACTOR")
            start, stop = int(bits[0]), int(bits[1])
            step = bits[2] if len(bits) == 3 else "1"
            if step.startswith("x"):
                factor = int(step[1:])
                if factor < 2 or start <= 0:
                    raise argparse.ArgumentTypeError(f"{part!r}: a factor needs START > 0 and FACTOR >= 2")
                v = start
                while v <= stop:
                    out.append(v)
                    v *= factor
            else:
                if int(step) <= 0:
                    raise argparse.ArgumentTypeError(f"{part!r}: STEP must be positive")
                out.extend(range(start, stop + 1, int(step)))
        else:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: empty list")
    return list(dict.fromkeys(out))


def _chunk_list(text: str) -> List[Optional[int]]:
    return _int_list(text, allow_default=True)


def _name_list(choices: Sequence[str]) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(choices)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pyep.bench",
        description="Benchmark pyep's normal-mode dispatch/combine against an all_to_all_single baseline and DeepEP.",
        epilog="Lists: 1,2,4 or START:STOP[:STEP] (inclusive) or START:STOP:xFACTOR; chunk lists also take 'default'. "
               "Without --quick/--full/--tune the sweep varies one thing at a time around the reference case "
               "(tokens x hidden, SMs x hidden, top-k x experts, send x recv chunks). See bench/README.md.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the reference cases only: normal mode 4096 tokens, hidden 7168, top-8 of "
                      "256 experts, 24 SMs; low latency 128 tokens, hidden 7168, top-8 of 288 experts (smaller on cpu)")
    mode.add_argument("--full", action="store_true", help="the full product of every list")
    mode.add_argument("--tune", action="store_true", help="sweep SMs x NVL chunks for pyep and write the tuning file")
    p.add_argument("--tokens", type=_int_list, help="tokens per rank (default 128:8192:x2 on GPU, 128:2048:x2 on cpu)")
    p.add_argument("--hidden", type=_int_list, help="hidden sizes (default 2048,4096,7168)")
    p.add_argument("--topk", type=_int_list, help="experts per token (default 8)")
    p.add_argument("--experts", type=_int_list, help="total experts, rounded down to a multiple of the ranks (default 256)")
    p.add_argument("--sms", type=_int_list, help="SM counts, even (default 8:24:4 on GPU, 8,16,24 on cpu)")
    p.add_argument("--nvl-send", type=_chunk_list, dest="nvl_send", help="Config num_max_nvl_chunked_send_tokens values ('default': the op's recommended)")
    p.add_argument("--nvl-recv", type=_chunk_list, dest="nvl_recv", help="Config num_max_nvl_chunked_recv_tokens values ('default': the op's recommended)")
    p.add_argument("--ll-tokens", type=_int_list, dest="ll_tokens",
                   help="low-latency tokens per rank, also num_max_dispatch_tokens_per_rank (default 128 with --quick; "
                        "16:256:x2 on GPU, 32,128 on cpu)")
    p.add_argument("--ll-experts", type=_int_list, dest="ll_experts",
                   help="low-latency experts, rounded down to a multiple of the ranks (default 288 on GPU, 64 on cpu)")
    p.add_argument("--ll-nodes", type=_int_list, dest="ll_nodes", metavar="K[,K...]",
                   help="pyep's low-latency rows once more per node size k, on a low-latency Buffer of its own made with "
                        "PYEP_RANKS_PER_NODE=k (each k consecutive ranks one node; peers of other nodes through the "
                        "put/signal path); k must divide the ranks and be less than them (default: none)")
    p.add_argument("--ops", type=_name_list(OPS + FABRIC_OPS + LL_OPS),
                   help=f"operations to measure (default all: {','.join(OPS + FABRIC_OPS + LL_OPS)}; --tune: the tuned three)")
    p.add_argument("--ll", action="store_true", help=f"the low-latency ops only ({','.join(LL_OPS)}): short for --ops with them")
    p.add_argument("--impls", type=_name_list(IMPLS),
                   help="implementations (default pyep,baseline,deepep; pyep with --tune; deepep_v2: DeepEP V2's "
                        "ElasticBuffer, needs NCCL >= 2.30.4 and PYEP_BENCH_DEEPEP_V2 = its build folder)")
    p.add_argument("--mask-ratio", type=float, default=0.0, dest="mask_ratio", help="fraction of top-k choices set to -1 (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, help="untimed calls before timing (default 20 on GPU, 1 on cpu)")
    p.add_argument("--iters", type=int, help="timed calls per measurement (default 50 on GPU, 5 on cpu)")
    p.add_argument("--host-iters", type=int, dest="host_iters", help="calls timed on the host (the usual call, DeepEP's defaults) (default 10 on GPU, 2 on cpu; 0: skip)")
    p.add_argument("--flush-mb", type=int, default=256, dest="flush_mb", help="MiB written between timed GPU iterations to flush L2 (default 256)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda (NCCL; gloo where ranks share a GPU) or cpu (gloo) backend (default: cuda if GPUs)")
    p.add_argument("--nprocs", type=int, help="ranks to spawn when not under torchrun (default: GPU count, or 4 on cpu); "
                   "more ranks than GPUs share them (rank i on GPU i %% count, a gloo group): correctness, not speed")
    p.add_argument("--spawn", action="store_true", help="spawn ranks even if torchrun's environment or a process group is present")
    p.add_argument("--out", help="output folder (default bench/results/<host>-<timestamp>/)")
    p.add_argument("--no-plots", action="store_true", dest="no_plots", help="skip the PNG plots")
    p.add_argument("--replot", metavar="DIR", help="measure nothing: draw the PNG plots of DIR/results.json (a run on a "
                   "machine without matplotlib) into DIR and record them there")
    p.add_argument("--tuning-file", dest="tuning_file", help=f"where --tune writes (default ${tuning.ENV_FILE} or ~/.cache/pyep/tuning/<gpu>-<ranks>.json)")
    p.add_argument("--timeout", type=float, default=600, help="process group timeout, seconds (default 600)")
    p.add_argument("--quiet", action="store_true", help="no table rows or progress on stdout/stderr (JSON and files only)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("warmup", "iters", "host_iters", "nprocs"):
        v = getattr(args, name)
        if v is not None and v < (1 if name in ("iters", "nprocs") else 0):
            raise SystemExit(f"--{name.replace('_', '-')} = {v}: out of range")
    if args.ll and args.ops:
        raise SystemExit("--ll and --ops: pass one of them")
    if args.ll_nodes and min(args.ll_nodes) <= 0:
        raise SystemExit(f"--ll-nodes {','.join(map(str, args.ll_nodes))}: node sizes must be positive")
    if not 0 <= args.mask_ratio < 1:
        raise SystemExit(f"--mask-ratio = {args.mask_ratio}: expected 0 <= r < 1")
    return args


# ---- the sweep ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One point of the sweep. nvl_send/nvl_recv None: the op's recommended value (Buffer.get_*_config)."""
    tokens: int
    hidden: int
    topk: int
    experts: int
    num_sms: int
    nvl_send: Optional[int] = None
    nvl_recv: Optional[int] = None

    def sort_key(self):
        return (self.experts, self.topk, self.tokens, self.hidden, self.num_sms,
                -1 if self.nvl_send is None else self.nvl_send, -1 if self.nvl_recv is None else self.nvl_recv)


@dataclass(frozen=True)
class LLCase:
    """One low-latency point: tokens a rank (also num_max_dispatch_tokens_per_rank), hidden, top-k, experts."""
    tokens: int
    hidden: int
    topk: int
    experts: int

    def sort_key(self):
        return (self.experts, self.topk, self.tokens, self.hidden)


@dataclass
class Plan:
    mode: str            # quick | sweep | full | tune
    backend: str         # cuda | cpu
    lists: dict
    reference: dict
    cases: List[Case]
    ops: List[str]
    impls: List[str]
    warmup: int
    iters: int
    host_iters: int
    notes: List[str]
    ll_cases: List["LLCase"] = field(default_factory=list)
    ll_reference: dict = field(default_factory=dict)
    # --ll-nodes: the node sizes pyep's low-latency rows run again with (PYEP_RANKS_PER_NODE=k), and those skipped
    # ({k: why}: k does not divide the ranks, or k >= ranks, one node).
    ll_nodes: List[int] = field(default_factory=list)
    ll_nodes_skipped: dict = field(default_factory=dict)


def _reference(values: list, preferred):
    """The reference value of a dimension: the list's value nearest the reference case's (None, the
    recommended chunk size, if the list holds it, else the first)."""
    if preferred in values:
        return preferred
    if preferred is None or any(v is None for v in values):
        return values[0]
    return min(values, key=lambda v: (abs(v - preferred), -v))


def make_plan(args: argparse.Namespace, backend: str, num_ranks: int) -> Plan:
    """Resolves presets, explicit lists and the sweep mode into the list of cases."""
    mode = "quick" if args.quick else "tune" if args.tune else "full" if args.full else "sweep"
    preset = _SWEEPS[("quick" if mode == "quick" else "tune" if mode == "tune" else "sweep", backend)]
    notes = []
    lists = {}
    for dim in ("tokens", "hidden", "topk", "experts", "sms", "nvl_send", "nvl_recv"):
        given = getattr(args, dim)
        lists[dim] = list(given) if given is not None else list(preset[dim])
    note = _NOTES.get((mode, backend))
    if note and (args.tokens is None or args.hidden is None):
        notes.append(note)
    experts = []
    for e in lists["experts"]:
        eff = max(num_ranks, e // num_ranks * num_ranks)
        if eff != e:
            notes.append(f"experts {e} -> {eff}: a multiple of the {num_ranks} ranks")
        experts.append(eff)
    lists["experts"] = list(dict.fromkeys(experts))
    for name in ("tokens", "hidden", "topk"):
        if min(lists[name]) <= 0:
            raise SystemExit(f"--{name}: values must be positive")
    if max(lists["topk"]) > min(lists["experts"]):
        raise SystemExit(f"--topk {max(lists['topk'])}: more than the {min(lists['experts'])} experts")

    ref = {"tokens": _reference(lists["tokens"], REFERENCE["tokens"]),
           "hidden": _reference(lists["hidden"], REFERENCE["hidden"]),
           "topk": _reference(lists["topk"], REFERENCE["topk"]),
           "experts": _reference(lists["experts"], REFERENCE["experts"]),
           "num_sms": _reference(lists["sms"], REFERENCE["num_sms"]),
           "nvl_send": _reference(lists["nvl_send"], None),
           "nvl_recv": _reference(lists["nvl_recv"], None)}

    def case(tokens=None, hidden=None, topk=None, experts=None, num_sms=None, nvl_send="ref", nvl_recv="ref"):
        return Case(tokens or ref["tokens"], hidden or ref["hidden"], topk or ref["topk"], experts or ref["experts"],
                    num_sms or ref["num_sms"], ref["nvl_send"] if nvl_send == "ref" else nvl_send,
                    ref["nvl_recv"] if nvl_recv == "ref" else nvl_recv)

    L = lists
    if mode in ("full", "tune"):
        cases = [Case(*c) for c in itertools.product(L["tokens"], L["hidden"], L["topk"], L["experts"], L["sms"],
                                                      L["nvl_send"], L["nvl_recv"])]
    else:
        # One thing at a time around the reference (each pair that a plot needs varies together).
        cases = [case(tokens=t, hidden=h) for t in L["tokens"] for h in L["hidden"]]
        cases += [case(num_sms=s, hidden=h) for s in L["sms"] for h in L["hidden"]]
        cases += [case(topk=k, experts=e) for k in L["topk"] for e in L["experts"]]
        cases += [case(nvl_send=s, nvl_recv=r) for s in L["nvl_send"] for r in L["nvl_recv"]]
    cases = sorted(dict.fromkeys(cases), key=Case.sort_key)

    impls = list(args.impls) if args.impls else (["pyep"] if mode == "tune" else list(DEFAULT_IMPLS))
    ops = (list(LL_OPS) if args.ll else list(args.ops) if args.ops else
           list(TUNE_KINDS) if mode == "tune" else list(OPS + FABRIC_OPS + LL_OPS))
    if mode == "tune" and "pyep" not in impls:
        raise SystemExit("--tune measures pyep: include it in --impls")
    if not any(op in OPS + FABRIC_OPS for op in ops):
        cases = []  # low-latency ops only: no normal-mode case (and no normal-mode Buffer)
    ll_cases, ll_ref = [], {}
    if any(op in LL_OPS for op in ops):
        ll_cases, ll_ref = _ll_cases(args, mode, backend, num_ranks, lists, notes)
    ll_nodes, ll_nodes_skipped = _ll_nodes(args, ops, impls, ll_cases, num_ranks, notes)
    it = _ITERS[backend]
    return Plan(mode=mode, backend=backend, lists=lists, reference=ref, cases=cases, ops=ops, impls=impls,
                warmup=it["warmup"] if args.warmup is None else args.warmup,
                iters=it["iters"] if args.iters is None else args.iters,
                host_iters=it["host_iters"] if args.host_iters is None else args.host_iters, notes=notes,
                ll_cases=ll_cases, ll_reference=ll_ref, ll_nodes=ll_nodes, ll_nodes_skipped=ll_nodes_skipped)


def ll_nodes_key(k: int) -> str:
    """The `skipped` key of an --ll-nodes size k whose rows did not run."""
    return f"pyep low-latency ranks_per_node={k}"


def _ll_nodes(args: argparse.Namespace, ops: List[str], impls: List[str], ll_cases: List["LLCase"], num_ranks: int,
              notes: List[str]) -> Tuple[List[int], dict]:
    """--ll-nodes: the node sizes that run (pyep's low-latency rows once more each, PYEP_RANKS_PER_NODE=k) and those
    skipped with why. A k that does not divide the ranks is refused by pyep; k >= ranks is one node (nothing to
    emulate). DeepEP has no emulated nodes: a note says so."""
    given = list(getattr(args, "ll_nodes", None) or [])
    if not given:
        return [], {}
    if not ll_cases or "pyep" not in impls:
        notes.append(f"--ll-nodes {','.join(map(str, given))}: no pyep low-latency rows to run with emulated nodes "
                     f"({'no low-latency op' if not ll_cases else 'pyep is not among --impls'})")
        return [], {}
    run, skipped = [], {}
    for k in given:
        if k >= num_ranks:
            skipped[k] = (f"PYEP_RANKS_PER_NODE={k} on {num_ranks} ranks: one node, nothing to emulate (the one-node "
                          f"rows are these)")
        elif num_ranks % k:
            skipped[k] = f"PYEP_RANKS_PER_NODE={k} does not divide the {num_ranks} ranks"
        else:
            run.append(k)
    if "deepep" in impls or "deepep_v2" in impls:
        notes.append("--ll-nodes: pyep only; DeepEP has no emulated nodes (PYEP_RANKS_PER_NODE is pyep's): its "
                     "low-latency rows are one node's")
    return run, skipped


def _ll_cases(args: argparse.Namespace, mode: str, backend: str, num_ranks: int, lists: dict,
              notes: List[str]) -> Tuple[List[LLCase], dict]:
    """The low-latency cases and their reference: tokens (--ll-tokens) x hidden at the reference top-k and experts,
    top-k x experts (--ll-experts) at the reference tokens and hidden (--full: the product). Hidden and top-k are the
    normal lists (--hidden, --topk); experts are rounded down to a multiple of the ranks, as the normal ones."""
    preset = _LL_SWEEPS[("quick" if mode == "quick" else "sweep", backend)]
    for dim in ("ll_tokens", "ll_experts"):
        given = getattr(args, dim)
        lists[dim] = list(given) if given is not None else list(preset[dim])
    if min(lists["ll_tokens"]) <= 0:
        raise SystemExit("--ll-tokens: values must be positive")
    note = _NOTES.get(("quick-ll", backend)) if mode == "quick" else None
    if note and (args.hidden is None or args.ll_experts is None):
        notes.append(note)
    experts = []
    for e in lists["ll_experts"]:
        eff = max(num_ranks, e // num_ranks * num_ranks)
        if eff != e:
            notes.append(f"low-latency experts {e} -> {eff}: a multiple of the {num_ranks} ranks")
        experts.append(eff)
    lists["ll_experts"] = list(dict.fromkeys(experts))
    if max(lists["topk"]) > min(lists["ll_experts"]):
        raise SystemExit(f"--topk {max(lists['topk'])}: more than the {min(lists['ll_experts'])} low-latency experts")
    ref = {"tokens": _reference(lists["ll_tokens"], LL_REFERENCE["tokens"]),
           "hidden": _reference(lists["hidden"], LL_REFERENCE["hidden"]),
           "topk": _reference(lists["topk"], LL_REFERENCE["topk"]),
           "experts": _reference(lists["ll_experts"], LL_REFERENCE["experts"])}
    L = lists
    if mode == "full":
        cases = [LLCase(*c) for c in itertools.product(L["ll_tokens"], L["hidden"], L["topk"], L["ll_experts"])]
    else:
        cases = [LLCase(t, h, ref["topk"], ref["experts"]) for t in L["ll_tokens"] for h in L["hidden"]]
        cases += [LLCase(ref["tokens"], ref["hidden"], k, e) for k in L["topk"] for e in L["ll_experts"]]
    return sorted(dict.fromkeys(cases), key=LLCase.sort_key), ref
