"""DeepEP V2 (`deep_ep.ElasticBuffer`) beside pyep and DeepEP V1: importing it, when it can run, and its runners.

Written against DeepEP's main line (github.com/deepseek-ai/DeepEP at dd758ca, `deep_ep/buffers/elastic.py`); the
bench README's "DeepEP V2" section says how to build and run it (NCCL >= 2.30.4 in the whole process). On the cpu
backend tests/test_bench_deepep_v2.py drives it against a one-rank stand-in.

It touches only V2's public Python API (deep_ep/buffers/elastic.py, deep_ep/utils/event.py):
`ElasticBuffer(group, num_max_tokens_per_rank=, hidden=, num_topk=, use_fp8_dispatch=, explicitly_destroy=True)`,
`dispatch`, `combine`, their return tuples, `EPHandle`'s public fields, `EventOverlap.current_stream_wait`,
`get_theoretical_num_sms`, `destroy` and `deep_ep.topk_idx_t`.

How V2 maps onto the bench's ops (V2 has no layout call, no Config and no low-latency API of its own):

| bench op        | V2 call                                                                                     |
| --------------- | ------------------------------------------------------------------------------------------- |
| layout          | none (V2 computes the layout inside dispatch): not measured                                 |
| dispatch_bf16   | dispatch(x, topk_idx=, topk_weights=, num_experts=E, num_max_tokens_per_rank=T, num_sms=SMs) |
| dispatch_fp8    | the same with x = (e4m3 [T, H], float32 scales [T, H/128]), as V1's normal mode takes it      |
| dispatch_cached | dispatch(x, handle=handle, num_sms=SMs) (no CPU sync, layout reused)                          |
| combine_bf16    | combine(recv_x, handle, num_sms=SMs) (no weights, no bias)                                   |
| ll_dispatch     | dispatch((e4m3, scales), topk_idx=, topk_weights=, num_experts=E, num_max_tokens_per_rank=M, |
|                 | expert_alignment=1, do_cpu_sync=False, do_expand=True) (the decode path: no host sync, rows  |
|                 | grouped by local expert); the FP8 cast is the caller's in V2 and is not timed                |
| ll_combine      | combine(expert_rows, handle) (V2's combine sums rows; weights are applied to the rows before) |

Bytes are the bench's (DeepEP V1's tests') counts, so that a GB/s column compares the same bytes across
implementations; V2's own test (tests/elastic/test_ep.py) counts more: the top-k indices and weights too.
"""
import importlib
import os
import sys
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .deepep_runner import ENV_ON_CPU
from .ep_runner import EPRunner
from .ll_runner import LowLatencyRunner, combine_error, ll_bytes, ll_call
from .plan import LL_OPS, Case, LLCase

NAME = "deepep_v2"
# The root of a V2 build: the folder that holds deep_ep/ with deep_ep/_C*.so built in place (setup.py build_ext
# --inplace). Unset: `import deep_ep` as sys.path finds it.
ENV_SRC = "PYEP_BENCH_DEEPEP_V2"
# V2's package is named deep_ep, as V1's is: once imported, its modules are kept under this name instead, so that a
# later `import deep_ep` (V1, the `deepep` column) finds V1. V1's modules already imported are put back afterwards.
ALIAS = "deep_ep_v2"
# Normal-mode ops V2 has (no layout: dispatch computes it).
OPS = ("dispatch_bf16", "dispatch_fp8", "dispatch_cached", "combine_bf16")
# The low-latency-equivalent dispatch: rows grouped by local expert, each expert's rows aligned to this.
LL_EXPERT_ALIGNMENT = 1
# dispatch's do_handle_copy (V2's default True: the handle keeps a clone of topk_idx, one small copy per call).
DO_HANDLE_COPY = True
# How long V2's kernels wait for a peer (its default 100 s): every new shape JIT-compiles its kernels with nvcc at
# first use, on each rank, so a rank may reach a kernel long before its peer.
GPU_TIMEOUT_S = 600


def _buffer(module, group: dist.ProcessGroup, tokens: int, hidden: int, topk: int, fp8: bool):
    """An ElasticBuffer on the group's NCCL communicator (V2 takes torch's: deep_ep/utils/comm.py)."""
    if os.environ.get(ENV_ON_CPU) != "1" and dist.get_backend(group) != "nccl":
        raise RuntimeError(f"DeepEP V2 needs an NCCL process group (V2 reuses its communicator), not "
                           f"{dist.get_backend(group)}")
    return module.ElasticBuffer(group, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk,
                                use_fp8_dispatch=fp8, num_gpu_timeout_secs=GPU_TIMEOUT_S, explicitly_destroy=True)


def _is_deep_ep_key(key: str) -> bool:
    return key == "deep_ep" or key.startswith("deep_ep.")


def _import_deepep_v2() -> Tuple[object, dict]:
    """(module or None, {"version", "skipped", "path"}) for DeepEP V2; never raises.

    V2 is imported as `deep_ep` (its modules import `deep_ep._C` by that name), from $PYEP_BENCH_DEEPEP_V2 when set,
    and then re-homed under `deep_ep_v2` in sys.modules; whatever `deep_ep` modules were there before (V1's) are put
    back. Importing V2 runs its `check_nccl_so()` (exactly one libnccl mapped, byte-equal to the one it was built
    against) and `init_jit()` (deep_ep/__init__.py:46-84): a failure there is the skip reason.

    V1's `deep_ep_cpp` and V2's `deep_ep._C` both register the C++ class `deep_ep::EventHandle` with pybind11, so in
    a process that loaded V1 this import fails with 'generic_type: type "EventHandle" is already registered!' (seen
    on 2x H200): then V2 is the one skipped, with that message."""
    if ALIAS in sys.modules:
        mod = sys.modules[ALIAS]
        return mod, {"version": getattr(mod, "__version__", None), "skipped": None,
                     "path": os.path.dirname(getattr(mod, "__file__", "") or "")}
    root = os.environ.get(ENV_SRC) or None
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if _is_deep_ep_key(k)}
    if root:
        sys.path.insert(0, root)
    mod, err = None, None
    try:
        mod = importlib.import_module("deep_ep")
        if not hasattr(mod, "ElasticBuffer"):
            err = (f"deep_ep at {os.path.dirname(getattr(mod, '__file__', '') or '?')} has no ElasticBuffer "
                   f"(not DeepEP V2; set {ENV_SRC} to V2's build folder)")
            mod = None
    except BaseException as e:  # noqa: BLE001 - any import failure (SystemExit of a failed assert too) is a reason
        err = f"import deep_ep (V2) failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        mod = None
    finally:
        if root:
            try:
                sys.path.remove(root)
            except ValueError:
                pass
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if _is_deep_ep_key(k)}
    if mod is not None:
        for k, m in ours.items():
            sys.modules[ALIAS + k[len("deep_ep"):]] = m
    sys.modules.update(saved)
    if mod is None:
        return None, {"version": None, "skipped": err, "path": root}
    return mod, {"version": getattr(mod, "__version__", None), "skipped": None,
                 "path": os.path.dirname(getattr(mod, "__file__", "") or "")}


def why_not(cuda: bool, shared_gpu: bool, num_ranks: int, num_gpus: int) -> Optional[str]:
    """Why DeepEP V2 cannot run in this group (None: it can)."""
    if not cuda and os.environ.get(ENV_ON_CPU) != "1":
        return "cpu backend: DeepEP V2 needs CUDA GPUs (and NCCL >= 2.30.4)"
    if shared_gpu:
        return (f"ranks share a GPU ({num_ranks} ranks on {num_gpus} GPU{'s' if num_gpus != 1 else ''}): "
                "DeepEP V2 needs one GPU per rank (an NCCL communicator)")
    return None


def _tokens_per_rank(topk_idx: torch.Tensor, experts: int, num_ranks: int) -> List[int]:
    """This rank's tokens that go to each rank: a token goes once to each rank holding any of its experts (experts
    split evenly, rank r holding [r*E/R, (r+1)*E/R)). -1 entries select nothing."""
    per = experts // num_ranks
    dst = torch.where(topk_idx >= 0, topk_idx.long() // per, torch.full_like(topk_idx.long(), num_ranks))
    hit = torch.zeros((topk_idx.size(0), num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, dst, True)
    return hit[:, :num_ranks].sum(dim=0).tolist()


class DeepEPV2Runner(EPRunner):
    """deep_ep.ElasticBuffer (DeepEP V2) in normal mode. One buffer for the run, sized by V2 for the largest tokens,
    hidden and top-k of the cases (BF16: the larger). SMs: the case's, passed as `num_sms` to every call (V2 would
    otherwise pick `get_theoretical_num_sms(E, topk)`, recorded in the note). No Config: the JSON's config is null
    and the NVL chunk sizes do not apply (sweep.py keys its cases without them)."""

    name = NAME
    ops = OPS

    def __init__(self, module, group: dist.ProcessGroup) -> None:
        super().__init__(module, group)  # EPRunner: module, group, num_ranks, topk_t = module.topk_idx_t
        self.rank = group.rank()
        self.note = None

    def open(self, cases: List[Case]) -> None:
        tokens = max(c.tokens for c in cases)
        hidden = max(c.hidden for c in cases)
        topk = max(c.topk for c in cases)
        self.buffer = _buffer(self.module, self.group, tokens, hidden, topk, False)
        b = self.buffer
        try:
            ref = min(cases, key=lambda c: (abs(c.tokens - 4096), abs(c.hidden - 7168)))
            theory = b.get_theoretical_num_sms(ref.experts, ref.topk)
        except Exception as e:  # noqa: BLE001 - informative only
            theory = f"unknown ({type(e).__name__})"
        self.note = (f"deepep_v2: DeepEP V2 {getattr(self.module, '__version__', '?')} ElasticBuffer, "
                     f"{b.num_bytes / 2 ** 20:.0f} MiB, domains scale-out x scale-up {b.num_scaleout_ranks}x"
                     f"{b.num_scaleup_ranks} (RDMA x NVLink {b.num_rdma_ranks}x{b.num_nvlink_ranks}); SMs as each "
                     f"case sets them, for its communication kernels (V2's copy and reduce epilogues use every SM; "
                     f"V2's own choice here, prefer_overlap_with_compute: {theory}); no layout op; its non-cached "
                     f"dispatch waits for the counts on the host (do_cpu_sync), as V1's; EP_DISABLE_GIN="
                     f"{os.environ.get('EP_DISABLE_GIN', '0')}")

    def prepare(self, case: Case, data: dict, full: bool = True) -> dict:
        """Untimed: one BF16 dispatch, for the handle (cached dispatch, combine) and the received rows; checks the
        received token count against the routing of all ranks (gathered before any V2 call, so that a V2 failure
        on one rank cannot leave the others waiting in the gather)."""
        topk_idx = data["topk_idx"].to(self.topk_t)
        if not full:
            return dict(topk_idx=topk_idx, recv_tokens=None)
        gathered: List[Optional[list]] = [None] * self.num_ranks
        dist.all_gather_object(gathered, _tokens_per_rank(topk_idx, case.experts, self.num_ranks), group=self.group)
        expected = sum(g[self.rank] for g in gathered)
        kw = dict(topk_idx=topk_idx, topk_weights=data["topk_weights"], num_experts=case.experts,
                  num_max_tokens_per_rank=case.tokens, num_sms=case.num_sms, do_handle_copy=DO_HANDLE_COPY)
        recv_x, _, _, handle, _ = self.buffer.dispatch(data["x"], **kw)
        recv_tokens = int(recv_x.size(0))
        if recv_tokens != expected or int(handle.num_recv_tokens) != expected:
            raise RuntimeError(f"check: received {recv_tokens} rows (handle {handle.num_recv_tokens}), expected "
                               f"{expected} from the routing")
        return dict(topk_idx=topk_idx, kw=kw, recv_x=recv_x, handle=handle, recv_tokens=recv_tokens)

    def op(self, op: str, case: Case, data: dict, st: dict):
        """(timed callable, host callable: the usual call (V2's defaults), wait for the host callable's result (nothing
        to join), None: no Config)."""
        b, x = self.buffer, data["x"]
        if op in ("dispatch_bf16", "dispatch_fp8"):
            if op == "dispatch_fp8" and data["fp8"] is None:
                raise ValueError(f"hidden {case.hidden}: FP8 needs a multiple of 128")
            xx = x if op == "dispatch_bf16" else data["fp8"]

            def call():
                return b.dispatch(xx, **st["kw"])
        elif op == "dispatch_cached":
            def call():
                return b.dispatch(x, handle=st["handle"], num_sms=case.num_sms)
        elif op == "combine_bf16":
            def call():
                return b.combine(st["recv_x"], st["handle"], num_sms=case.num_sms)
        else:
            raise ValueError(f"{op}: not a DeepEP V2 op")
        return call, call, (lambda r: None), None

    def host_prep(self, op: str, case: Case, data: dict, st: dict) -> None:
        """Nothing before a host-timed call: V2's dispatch makes its layout itself."""
        return None

    def low_latency(self) -> LowLatencyRunner:
        return DeepEPV2LowLatencyRunner(self.name, self.module, self.group)

    def close(self) -> None:
        """Destroys the buffer (collective: V2's destroy runs a barrier, csrc/elastic/buffer.hpp:152-166)."""
        buffer, self.buffer = self.buffer, None
        if buffer is not None and getattr(buffer, "runtime", None) is not None:
            buffer.destroy()


def _expanded_rows(recv: Tuple[torch.Tensor, torch.Tensor], recv_w: Optional[torch.Tensor], handle,
                   alignment: int) -> Tuple[torch.Tensor, List[int]]:
    """The BF16 rows of an expanded FP8 dispatch (values times their scale per 128 channels), each multiplied by its
    received weight, zeros outside the experts' valid ranges; and each local expert's count. Expand mode
    (deep_ep/buffers/elastic.py:44-48): expert i's rows are [align(psum[i-1], a), psum[i]) (start 0 for i = 0)."""
    values, scales = recv
    n, hidden = values.shape
    psum = handle.psum_num_recv_tokens_per_expert.tolist()
    valid = torch.zeros((n,), dtype=torch.bool, device=values.device)
    counts, prev = [], 0
    for end in psum:
        start = -(-prev // alignment) * alignment if prev else 0
        counts.append(max(0, end - start))
        if end > start:
            valid[start:end] = True
        prev = end
    rows = torch.zeros((n, hidden), dtype=torch.bfloat16, device=values.device)
    idx = valid.nonzero().squeeze(1)
    if idx.numel():
        v = values[idx].float().view(-1, hidden // 128, 128) * scales[idx].float().view(-1, hidden // 128, 1)
        v = v.view(-1, hidden)
        if recv_w is not None:
            v = v * recv_w[idx].float().view(-1, 1)
        rows[idx] = v.to(torch.bfloat16)
    return rows, counts


class DeepEPV2LowLatencyRunner(LowLatencyRunner):
    """V2 at the low-latency cases. V2 has no low-latency API (README.md:17-22, 30: one ElasticBuffer interface; the
    0-SM hooked mode is gone), so this times the dispatch without CPU sync in the expanded layout that V2's own test
    runs with --do-cpu-sync 0 (tests/elastic/test_ep.py): do_cpu_sync=False gives fixed worst-case output shapes and
    no host wait, like V1's low_latency_dispatch; the expanded layout groups rows by local expert (V1's low-latency
    layout's counterpart); then combine. SMs: V2's own (`num_sms=0`: get_theoretical_num_sms). No hooks: no send/recv
    µs.
    A Buffer of its own (like V1's low-latency Buffer), sized for the low-latency cases, FP8 dispatch."""

    ops = LL_OPS

    def open(self, cases: List[LLCase]) -> None:
        self.buffer = _buffer(self.module, self.group, max(c.tokens for c in cases), max(c.hidden for c in cases),
                              max(c.topk for c in cases), True)

    def _dispatch(self, case: LLCase, st: dict, **a):
        return self.buffer.dispatch(st["fp8"], topk_idx=st["topk_idx"], topk_weights=st["weights"],
                                    num_experts=case.experts, num_max_tokens_per_rank=case.tokens,
                                    expert_alignment=LL_EXPERT_ALIGNMENT, num_sms=0, do_handle_copy=DO_HANDLE_COPY,
                                    do_cpu_sync=False, do_expand=True, **a)

    def prepare(self, case: LLCase, data: dict, full: bool = True) -> dict:
        """Untimed: one dispatch and one combine of its rows (dequantized, times their weights), checked as the V1
        low-latency rows are (ll_runner.py): each local expert's count (and cumulative_local_expert_recv_stats)
        against all ranks' routing, and the combine against x times the sum of the token's valid weights."""
        b, H, E = self.buffer, case.hidden, case.experts
        R, L = self.num_ranks, case.experts // self.num_ranks
        if data["fp8"] is None:
            raise ValueError(f"hidden {H}: FP8 needs a multiple of 128")
        x, weights = data["x"], data["topk_weights"]
        topk_idx = data["topk_idx"].to(self.topk_t)
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid].long().cpu(), minlength=E).tolist()
        gathered: List[Optional[list]] = [None] * R
        dist.all_gather_object(gathered, per_expert, group=self.group)  # before any V2 call (see DeepEPV2Runner)
        expected = [sum(g[self.rank * L + i] for g in gathered) for i in range(L)]
        st = dict(fp8=data["fp8"], topk_idx=topk_idx, weights=weights)
        stats = torch.zeros((L,), dtype=torch.int32, device=x.device)
        recv, _, recv_w, handle, _ = self._dispatch(case, st, cumulative_local_expert_recv_stats=stats)
        if x.is_cuda:
            torch.cuda.synchronize()
        expert_rows, got = _expanded_rows(recv, recv_w, handle, LL_EXPERT_ALIGNMENT)
        combined, _, _ = b.combine(expert_rows, handle)
        if x.is_cuda:
            torch.cuda.synchronize()
        unaligned = handle.num_unaligned_recv_tokens_per_expert
        if got != expected or stats.tolist() != expected or (unaligned is not None and unaligned.tolist() != expected):
            raise RuntimeError(f"check: per-expert counts {got} (stats {stats.tolist()}), expected {expected}")
        err = combine_error(x, weights, valid, combined)
        st.update(handle=handle, expert_rows=expert_rows, recv_tokens=int(sum(got)), selections=int(valid.sum()),
                  combine_err=round(err, 5))
        return st

    def op(self, op: str, case: LLCase, data: dict, st: dict):
        """(timed callable, host callable, wait, None): the plain calls, as the V1 low-latency rows."""
        rows = st["expert_rows"]

        def dispatch(**a):
            return self._dispatch(case, st, **a)

        def combine(handle, **a):
            return self.buffer.combine(rows, handle, **a)

        call = ll_call(op, dispatch, combine, st["handle"], 3)
        return call, call, (lambda r: None), None

    def send_phase(self, op: str, case: LLCase, data: dict, st: dict):
        return None  # V2 has no receive hook

    def op_bytes(self, op: str, case: LLCase, st: dict) -> int:
        return ll_bytes(op, st["selections"], case.hidden)

    def close(self) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None and getattr(buffer, "runtime", None) is not None:
            buffer.destroy()
