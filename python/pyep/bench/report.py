"""The report: per-rank records merged, the table, the progress bar, results.json, table.txt and tuning."""
import datetime
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import pyep
from .. import tuning
from .plan import FP8_FACTOR, LL_OPS, TUNE_KINDS, Plan
from .plots import plot

SCHEMA = "pyep-bench/4"


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _gbps(x: float) -> float:
    """A bandwidth kept to four significant digits: rounding to decimals made a slow cpu run's small figure 0.0."""
    return float(f"{x:.4g}")


def _bytes_of(op: str, recv_tokens: int, hidden: int) -> int:
    """Bytes DeepEP's tests count for an op on one rank: dispatch BF16, combine and alltoall, the received rows as BF16
    (combine's rows sent back are the same rows); FP8, that times (1 + 4/128) / 2; layout, none."""
    if op == "layout":
        return 0
    bf16 = recv_tokens * hidden * 2
    return int(bf16 * FP8_FACTOR) if op == "dispatch_fp8" else bf16


def _merge(records: List[dict]) -> dict:
    """One result from every rank's record of one measurement (same order on all ranks)."""
    first = records[0]
    out = {k: first[k] for k in ("impl", "op", "tokens", "hidden", "topk", "experts", "num_sms", "nvl_send", "nvl_recv", "config")}
    if first["op"] in LL_OPS:
        # The low-latency Buffer's nodes (error rows too): ranks_per_node 0 for one node, k for PYEP_RANKS_PER_NODE=k.
        out["ranks_per_node"] = first.get("ranks_per_node", 0)
        out["num_nodes"] = first.get("num_nodes", 1)
    errors = [r["error"] for r in records if r.get("error")]  # agreed: the same on every rank, naming the rank
    out["error"] = errors[0] if errors else None
    if errors:
        out["per_rank"] = []
        return out
    per_rank = [{k: r.get(k) for k in ("rank", "median_us", "min_us", "max_us", "host_us", "launch_us", "result_us",
                                        "recv_tokens", "bytes", "gbps", "times_us")}
                for r in records]
    out["per_rank"] = per_rank
    medians = [r["median_us"] for r in per_rank]
    out["time_us_avg"] = round(statistics.fmean(medians), 3)
    out["time_us_max_rank"] = round(max(medians), 3)
    out["time_us_min"] = round(min(r["min_us"] for r in per_rank), 3)
    out["time_us_max"] = round(max(r["max_us"] for r in per_rank), 3)
    gb = [r["gbps"] for r in per_rank if r["gbps"] is not None]
    out["gbps_avg"] = _gbps(statistics.fmean(gb)) if gb else None
    out["gbps_min"] = _gbps(min(gb)) if gb else None
    for key in ("host_us", "launch_us", "result_us"):
        values = [r[key] for r in per_rank if r[key] is not None]
        out[key + "_avg"] = round(statistics.fmean(values), 3) if values else None
    recv = [r["recv_tokens"] for r in per_rank if r["recv_tokens"] is not None]
    out["recv_tokens_avg"] = round(statistics.fmean(recv), 1) if recv else None
    out["bytes_total"] = sum(r["bytes"] for r in per_rank)
    if first["op"] in LL_OPS:
        # Low-latency rows only: the hooked call's send and receive phases, and the check's combine error.
        for p, r in zip(per_rank, records):
            p.update(send_us=r.get("send_us"), recv_us=r.get("recv_us"), combine_err=r.get("combine_err"))
        for key in ("send_us", "recv_us"):
            values = [p[key] for p in per_rank if p[key] is not None]
            out[key + "_avg"] = round(statistics.fmean(values), 3) if values else None
        errs = [p["combine_err"] for p in per_rank if p["combine_err"] is not None]
        out["combine_err_max"] = max(errs) if errs else None
    return out


class Table:
    """The stdout table, one row a measurement."""

    def __init__(self) -> None:
        enc = (getattr(sys.stdout, "encoding", None) or "").lower()
        self.mu = "µs" if "utf" in enc else "us"
        self.cols = [("impl", 9, "<"), ("op", 15, "<"), ("tokens", 6, ">"), ("hidden", 6, ">"), ("topk", 4, ">"),
                     ("experts", 7, ">"), ("SMs", 3, ">"), ("nvl s/r", 7, ">"), ("recv", 7, ">"),
                     (f"time {self.mu}", 10, ">"), ("(min-max)", 19, "<"), ("GB/s avg", 8, ">"), ("GB/s min", 8, ">"),
                     (f"launch {self.mu}", 9, ">"), (f"call {self.mu}", 8, ">"), (f"result {self.mu}", 9, ">")]

        # Low-latency rows: no SMs or Config; the Buffer's nodes (-: one node; 2x2: 2 emulated nodes of 2 ranks,
        # PYEP_RANKS_PER_NODE=2); the hooked call's send and receive phases.
        self.ll_cols = [("op", 19, "<") if c[0] == "op" else c for c in self.cols if c[0] not in ("SMs", "nvl s/r")] + [
            (f"send {self.mu}", 8, ">"), (f"recv {self.mu}", 8, ">")]
        self.ll_cols.insert(1, ("nodes", 5, "<"))

    @staticmethod
    def _head(cols) -> str:
        head = " ".join(f"{name:{align}{width}}" for name, width, align in cols).rstrip()
        return head + "\n" + "-" * len(head)

    def header(self) -> str:
        return self._head(self.cols)

    def ll_header(self) -> str:
        return "low latency (FP8 dispatch, BF16 combine; GB/s in DeepEP's low-latency count)\n" + self._head(self.ll_cols)

    def row(self, r: dict) -> str:
        def num(v, fmt):
            return "-" if v is None else format(v, fmt)
        if r["op"] in LL_OPS:
            return self._ll_row(r, num)
        cfg = r.get("config")
        if cfg:
            chunks = f"{cfg[1]}/{cfg[2]}"
        elif r["nvl_send"] is not None or r["nvl_recv"] is not None:  # asked for, but no Config came of it
            chunks = f"{r['nvl_send'] or 'd'}/{r['nvl_recv'] or 'd'}"
        else:
            chunks = "-"
        sms = str(r["num_sms"]) if r["num_sms"] is not None else "-"
        head = [r["impl"], r["op"], str(r["tokens"]), str(r["hidden"]), str(r["topk"]), str(r["experts"]), sms, chunks]
        if r.get("error"):
            vals = head + [f"ERROR {r['error']}"]
            return " ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, self.cols)).rstrip()
        vals = head + [num(r["recv_tokens_avg"], ".0f"), num(r["time_us_avg"], ".1f"),
                       f"({r['time_us_min']:.1f}-{r['time_us_max']:.1f})", num(r["gbps_avg"], ".2f"),
                       num(r["gbps_min"], ".2f"), num(r.get("launch_us_avg"), ".1f"), num(r["host_us_avg"], ".1f"),
                       num(r.get("result_us_avg"), ".1f")]
        return " ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, self.cols)).rstrip()


    @staticmethod
    def nodes(r: dict) -> str:
        """A low-latency row's nodes column: `-` for one node, `NxK` for N emulated nodes of K ranks."""
        k = r.get("ranks_per_node") or 0
        return f"{r.get('num_nodes')}x{k}" if k else "-"

    def _ll_row(self, r: dict, num) -> str:
        head = [r["impl"], self.nodes(r), r["op"], str(r["tokens"]), str(r["hidden"]), str(r["topk"]), str(r["experts"])]
        if r.get("error"):
            vals = head + [f"ERROR {r['error']}"]
        else:
            vals = head + [num(r["recv_tokens_avg"], ".0f"), num(r["time_us_avg"], ".1f"),
                           f"({r['time_us_min']:.1f}-{r['time_us_max']:.1f})", num(r["gbps_avg"], ".2f"),
                           num(r["gbps_min"], ".2f"), num(r.get("launch_us_avg"), ".1f"), num(r["host_us_avg"], ".1f"),
                           num(r.get("result_us_avg"), ".1f"), num(r.get("send_us_avg"), ".1f"),
                           num(r.get("recv_us_avg"), ".1f")]
        return " ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, self.ll_cols)).rstrip()


class Progress:
    """A plain-text progress bar on stderr (tqdm when importable and stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n, self.enabled = total, 0, enabled and total > 1
        self.tty = self.enabled and sys.stderr.isatty()
        self.bar = None
        self.last_pct = -1
        self.t0 = time.perf_counter()
        if self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="case", file=sys.stderr, leave=False)
            except ImportError:
                self.bar = None

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(line, flush=True)
        if self.tty:
            self._draw()

    def _draw(self) -> None:
        if not self.enabled or self.bar is not None:
            return
        pct = int(100 * self.n / self.total)
        width = 30
        filled = width * self.n // self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.n * (self.total - self.n) if self.n else 0
        text = f"[{'#' * filled}{'.' * (width - filled)}] {self.n}/{self.total} cases {pct:3d}% eta {eta:5.0f}s"
        if self.tty:
            sys.stderr.write("\r" + text)
            sys.stderr.flush()
        elif pct // 10 != self.last_pct // 10 or self.n == self.total:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        self.last_pct = pct

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            self._draw()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self.bar, self.enabled, self.tty = None, False, False


def default_out_dir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("bench", "results", f"{socket.gethostname()}-{stamp}")


def tune_table(results: List[dict], num_ranks: int, device: str, default_hidden: Optional[int] = None,
               source: Optional[dict] = None) -> dict:
    """The tuning file content (see pyep.tuning) from a report's results: pyep's dispatch_bf16, dispatch_fp8 and
    combine_bf16 measurements, per (hidden, config) the time and GB/s averaged over the tokens measured."""
    acc: Dict[Tuple[int, str], Dict[Tuple[int, ...], List[Tuple[float, float]]]] = {}
    for r in results:
        if r["impl"] != "pyep" or r["op"] not in TUNE_KINDS or r.get("error") or not r.get("config"):
            continue
        acc.setdefault((r["hidden"], TUNE_KINDS[r["op"]]), {}).setdefault(tuple(r["config"]), []).append(
            (r["time_us_avg"], r["gbps_avg"] or 0.0))
    measured = {key: {cfg: (statistics.fmean(t for t, _ in v), statistics.fmean(g for _, g in v)) for cfg, v in by.items()}
                for key, by in acc.items()}
    return tuning.make_table(num_ranks, device, measured, default_hidden=default_hidden, source=source,
                             pyep_version=pyep.__version__)


@dataclass
class Part:
    """What a run measured, as rank 0 holds it before the report is written: the whole run's, or one of the
    launcher's two sets of processes' (see merge_parts). lines: the output so far, as table.txt has it."""
    plan: Plan
    env: dict
    skipped: Dict[str, str]
    results: List[dict]
    lines: List[str]
    elapsed: float
    out_dir: str
    num_ranks: int
    cuda: bool
    shared: bool


def merge_parts(first: Part, second: Part) -> Part:
    """One run's Part from the launcher's two sets of processes: `first` (every row but the emulated-node ones) and
    `second` (those rows alone). The second's rows, output lines, skips, new notes and time follow the first's (its
    rows after every one-node row, where a run in one set puts them too); the environment and the plan are the
    first's."""
    notes = list(first.plan.notes)
    notes += [n for n in second.plan.notes if n not in notes]
    return Part(plan=replace(first.plan, notes=notes), env=first.env,
                skipped={**first.skipped, **second.skipped}, results=first.results + second.results,
                lines=first.lines + second.lines, elapsed=first.elapsed + second.elapsed, out_dir=first.out_dir,
                num_ranks=first.num_ranks, cuda=first.cuda, shared=first.shared)


def _finish(args, part: Part, table: Table, emit: Callable[[str], None]) -> dict:
    """Rank 0 (or the launcher, for its two sets of processes): the tuning file, the plots, results.json and
    table.txt (part.lines, with what emit adds to them)."""
    plan, env, skipped, results, elapsed, out_dir = (part.plan, part.env, part.skipped, part.results, part.elapsed,
                                                     part.out_dir)
    R, cuda, shared_gpu, lines = part.num_ranks, part.cuda, part.shared, part.lines
    report = {
        "schema": SCHEMA,
        "env": env,
        "args": dict(vars(args)),
        "plan": {"mode": plan.mode, "backend": plan.backend, "lists": plan.lists, "reference": plan.reference,
                 "ops": plan.ops, "impls": plan.impls, "warmup": plan.warmup, "iters": plan.iters,
                 "host_iters": plan.host_iters, "flush_mb": args.flush_mb if cuda else 0,
                 "num_cases": len(plan.cases), "notes": plan.notes, "ll_reference": plan.ll_reference,
                 "num_ll_cases": len(plan.ll_cases), "ll_nodes": plan.ll_nodes},
        "metrics": {
            "time": "per rank: median (min, max) over the timed calls; across ranks: the average of the medians",
            "gbps": "per rank: bytes / median time; dispatch_bf16, dispatch_cached, combine_bf16, alltoall_bf16: recv_tokens * hidden * 2;"
                    " dispatch_fp8: that * (1 + 4/128) / 2; layout: none. Reported as average and min over ranks",
            "host": "host_us, launch_us, result_us: per rank, the median over host_iters calls of the usual call "
                    "(DeepEP's defaults; baseline: the plain call), each after a barrier (and, untimed, for a dispatch a new "
                    "layout, for a combine a new dispatch) with the device idle; across ranks, the average",
            "host_us": "call time: time.perf_counter from the Python call to its return, nothing synchronized inside "
                       "(DeepEP has no launch stamp: this is its host figure)",
            "launch_us": "pyep on cuda only: from the Python call to right after its last kernel launch (the core's "
                         "CLOCK_MONOTONIC stamp); a dispatch returns later, once notify's counts reach the host",
            "result_us": "time to result with the GPU idle: from the Python call until the call has returned and "
                         "torch.cuda.synchronize() has returned (cpu: the call's return)",
            "ll": "low-latency rows (ll_dispatch: FP8, ll_combine: BF16, ll_dispatch_combine: both back to back, the "
                  "combine on the dispatch's handle), a Buffer with low_latency_mode=True; time as above, host figures of "
                  "the plain call (async_finish=False); recv_tokens: rows received by the rank's experts (sum of recv_count)",
            "ranks_per_node": "low-latency rows: the node size of the row's Buffer, 0 for one node (PYEP_RANKS_PER_NODE "
                              "unset); k > 0 (--ll-nodes, pyep only): made with PYEP_RANKS_PER_NODE=k, each k consecutive "
                              "ranks one node, peers of other nodes reached through the put/signal path; num_nodes: "
                              "ranks / k (one node: 1 up to 8 ranks)",
            "ll_gbps": "DeepEP's low-latency count (tests/test_low_latency.py), per rank over its valid top-k selections s: "
                       "ll_dispatch s * (hidden + hidden/128*4 + 16), ll_combine s * hidden * 2, ll_dispatch_combine the "
                       "sum; / the median time",
            "deepep_v2": "DeepEP V2's ElasticBuffer (--impls deepep_v2): the same whole-call time between CUDA events and "
                         "the same bytes as the others (V2's own test times the kernels alone with the profiler and also "
                         "counts top-k indices and weights); no layout op and no Config (SMs only, nvl s/r -); its "
                         "low-latency rows are V2's dispatch without CPU sync in the expanded layout (FP8 cast by the "
                         "caller, untimed), then its combine; no send/recv phases",
            "send_us, recv_us": "ll_dispatch and ll_combine with return_recv_hook=True: the call (send phase) and hook() "
                                "(receive phase), each between CUDA events (cpu: perf_counter), the hook after the device "
                                "idled and a barrier (every rank's sends done); per rank the median, across ranks the average",
            "combine_err": "the low-latency check, once per case before timing (recv_count against the routing, then a "
                           "combine of the dequantized rows against x * sum of valid weights): the largest per-token "
                           "relative L2 error; a failed check is the case's error instead of figures",
        },
        "skipped": skipped,
        "elapsed_s": round(elapsed, 3),
        "results": results,
        "tuning": None,
        "plots": [],
        "plots_skipped": None,
        "out_dir": os.path.abspath(out_dir),
    }
    if plan.mode == "tune":
        dev_name = tuning.device_name() if cuda else "cpu"
        source = {"tokens": plan.lists["tokens"], "topk": plan.lists["topk"], "experts": plan.lists["experts"],
                  "iters": plan.iters, "warmup": plan.warmup, "backend": plan.backend}
        tuned = tune_table(results, R, dev_name, plan.reference["hidden"], source)
        path = None
        if shared_gpu and not args.tuning_file:
            emit("tuning: ranks share a GPU: no tuning file written (it would stand for a host with a GPU a rank); "
                 "--tuning-file writes one anyway")
        elif tuned["hidden"]:
            path = tuning.save(tuned, args.tuning_file or tuning.tuning_path(R, dev_name))
            emit(f"tuning file: {path}")
        else:
            emit("tuning: no pyep measurement succeeded; no tuning file written")
        report["tuning"] = {"path": path, "table": tuned}
        for hidden, kinds in tuned["hidden"].items():
            for kind, entry in kinds.items():
                b = entry["best"]
                emit(f"  hidden {hidden} {kind:<12} best Config{tuple(b['config'])}: {b['gbps']:.2f} GB/s, "
                     f"{b['time_us']:.1f} {table.mu}")
    if args.no_plots:
        report["plots_skipped"] = "--no-plots"
    else:
        try:
            plots, report["plots_skipped"] = plot(results, plan.reference, out_dir)
            report["plots"] = [os.path.basename(p) for p in plots]
        except Exception as e:  # noqa: BLE001 - a plot must not lose the measurements
            report["plots_skipped"] = f"plotting failed: {_err(e)}"
        if report["plots_skipped"]:
            emit(f"plots: {report['plots_skipped']}")
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        f.write(tuning.dumps(report) + "\n")
    emit(f"wrote {path}" + "".join(f", {os.path.join(out_dir, p)}" for p in report["plots"]) + f" ({elapsed:.1f} s)")
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return report


def replot(out_dir: str) -> dict:
    """Draws the plots of the report in out_dir/results.json into out_dir and records them in the report."""
    path = os.path.join(out_dir, "results.json")
    with open(path) as f:
        report = json.load(f)
    plots, why = plot(report["results"], report["plan"]["reference"], out_dir)
    report["plots"], report["plots_skipped"] = [os.path.basename(p) for p in plots], why
    with open(path, "w") as f:
        f.write(tuning.dumps(report) + "\n")
    print(f"plots: {why}" if why else "wrote " + ", ".join(plots))
    return report
