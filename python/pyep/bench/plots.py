"""PNG plots of a report's GB/s (matplotlib, when importable)."""
import os
from typing import Callable, Dict, List, Optional, Tuple

from .plan import FABRIC_OPS, LL_OPS, OPS

IMPL_COLORS = {"pyep": "C0", "baseline": "C1", "deepep": "C2", "deepep_v2": "C4"}
STYLES = ("-", "--", ":", "-.")


def plot(results: List[dict], reference: dict, out_dir: str) -> Tuple[List[str], Optional[str]]:
    """GB/s against tokens (at the reference SMs) and against SMs (at the reference tokens), one panel an op,
    one line an (impl, hidden); and the low-latency ops' µs against tokens, one line an (impl, hidden, nodes).
    A colour an implementation. Returns (paths written, why nothing was written or None)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [], f"matplotlib is not importable ({e}): no plots"
    ok = [r for r in results if not r.get("error") and r.get("gbps_avg") is not None
          and r["topk"] == reference["topk"] and r["experts"] == reference["experts"]
          and r["nvl_send"] == reference["nvl_send"] and r["nvl_recv"] == reference["nvl_recv"]]
    ll = [r for r in results if not r.get("error") and r.get("time_us_avg") is not None and r["op"] in LL_OPS]
    written = []

    def figure(rows: List[dict], ops: tuple, value: str, xkey: str, fixed: Callable[[dict], bool], fname: str,
               xlabel: str, ylabel: str, log2: bool) -> None:
        panels = []
        for op in [op for op in ops if op != "layout" and any(r["op"] == op for r in rows)]:
            lines: Dict[Tuple[str, int, str], List[Tuple[int, float]]] = {}
            flat: Dict[Tuple[str, int, str], float] = {}
            for r in rows:
                if r["op"] != op or not fixed(r):
                    continue
                nodes = f"{r['num_nodes']}x{r['ranks_per_node']}" if (r.get("num_nodes") or 1) > 1 else ""
                if xkey == "num_sms" and r["num_sms"] is None:
                    # The baseline uses no SMs setting: a flat line at its value.
                    flat[(r["impl"], r["hidden"], nodes)] = r[value]
                else:
                    lines.setdefault((r["impl"], r["hidden"], nodes), []).append((r[xkey], r[value]))
            lines = {k: sorted(v) for k, v in lines.items() if len(v) >= 2}
            if lines:
                panels.append((op, lines, flat))
        if not panels:
            return
        ncols = min(2, len(panels))
        nrows = (len(panels) + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
        # A style a (hidden, nodes): solid for the first.
        kinds = sorted({k[1:] for _, lines, flat in panels for k in list(lines) + list(flat)})
        style = {k: STYLES[i % len(STYLES)] for i, k in enumerate(kinds)}
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (op, lines, flat) in zip(axes.flat, panels):
            for (impl, hidden, nodes), pts in sorted(lines.items()):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=IMPL_COLORS.get(impl, "C3"),
                        linestyle=style[(hidden, nodes)], label=f"{impl} h={hidden} {nodes}".rstrip())
            for (impl, hidden, nodes), v in sorted(flat.items()):
                ax.axhline(v, linestyle=style[(hidden, nodes)], linewidth=1, color=IMPL_COLORS.get(impl, "C3"), alpha=0.6,
                           label=f"{impl} h={hidden} {nodes}".rstrip())
            xs = sorted({p[0] for pts in lines.values() for p in pts})
            if log2:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(v) for v in xs], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(op)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    gbps = "GB/s (avg over ranks)"
    figure(ok, OPS + FABRIC_OPS, "gbps_avg", "tokens", lambda r: r["num_sms"] in (None, reference["num_sms"]),
           "gbps_vs_tokens.png", "tokens per rank", gbps, True)
    figure(ok, OPS + FABRIC_OPS, "gbps_avg", "num_sms", lambda r: r["tokens"] == reference["tokens"], "gbps_vs_sms.png",
           "SMs", gbps, False)
    figure(ll, LL_OPS, "time_us_avg", "tokens", lambda r: True, "ll_us_vs_tokens.png", "tokens per rank",
           "µs (median, avg over ranks)", True)
    return written, (None if written else "too few points for a plot (need a line of 2 or more)")
