"""PNG plots of a report's GB/s (matplotlib, when importable)."""
import os
from typing import Callable, Dict, List, Optional, Tuple

from .plan import FABRIC_OPS, OPS


def plot(results: List[dict], reference: dict, out_dir: str) -> Tuple[List[str], Optional[str]]:
    """GB/s against tokens (at the reference SMs) and against SMs (at the reference tokens), one panel an op,
    one line an (impl, hidden). Returns (paths written, why nothing was written or None)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [], f"matplotlib is not importable ({e}): no plots"
    ok = [r for r in results if not r.get("error") and r.get("gbps_avg") is not None
          and r["topk"] == reference["topk"] and r["experts"] == reference["experts"]
          and r["nvl_send"] == reference["nvl_send"] and r["nvl_recv"] == reference["nvl_recv"]]
    ops = [op for op in OPS + FABRIC_OPS if op != "layout" and any(r["op"] == op for r in ok)]
    written = []

    def figure(xkey: str, fixed: Callable[[dict], bool], fname: str, xlabel: str, log2: bool) -> None:
        panels = []
        for op in ops:
            lines: Dict[Tuple[str, int], List[Tuple[int, float]]] = {}
            flat: Dict[Tuple[str, int], float] = {}
            for r in ok:
                if r["op"] != op or not fixed(r):
                    continue
                if xkey == "num_sms" and r["num_sms"] is None:
                    # The baseline uses no SMs setting: a flat line at its value.
                    flat[(r["impl"], r["hidden"])] = r["gbps_avg"]
                else:
                    lines.setdefault((r["impl"], r["hidden"]), []).append((r[xkey], r["gbps_avg"]))
            lines = {k: sorted(v) for k, v in lines.items() if len(v) >= 2}
            if lines:
                panels.append((op, lines, flat))
        if not panels:
            return
        ncols = min(2, len(panels))
        nrows = (len(panels) + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
        hiddens = sorted({h for _, lines, flat in panels for (_, h) in list(lines) + list(flat)})
        colors = {h: f"C{i % 10}" for i, h in enumerate(hiddens)}
        styles = {"pyep": "-", "baseline": "--", "deepep": ":"}
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (op, lines, flat) in zip(axes.flat, panels):
            for (impl, hidden), pts in sorted(lines.items()):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=colors[hidden],
                        linestyle=styles.get(impl, "-"), label=f"{impl} h={hidden}")
            for (impl, hidden), v in sorted(flat.items()):
                ax.axhline(v, linestyle=styles.get(impl, "--"), linewidth=1, color=colors[hidden], alpha=0.6,
                           label=f"{impl} h={hidden}")
            xs = sorted({p[0] for pts in lines.values() for p in pts})
            if log2:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(v) for v in xs], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(op)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("GB/s (avg over ranks)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    figure("tokens", lambda r: r["num_sms"] in (None, reference["num_sms"]), "gbps_vs_tokens.png", "tokens per rank", True)
    figure("num_sms", lambda r: r["tokens"] == reference["tokens"], "gbps_vs_sms.png", "SMs", False)
    return written, (None if written else "too few points for a plot (need a line of 2 or more)")
