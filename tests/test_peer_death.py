"""A peer that dies: the survivors' calls fail within PYEP_TIMEOUT_S naming it, and the survivor's process can still
destroy its buffer and use its device (on cuda: the kernels stop waiting, no trap, the CUDA context survives).

Each case runs a group of its own, two processes started here (rank 0 of the launch starts them; the other ranks
only wait), since torchrun ends every rank when one dies. On cuda both share the launch's GPU (a gloo group with
PYEP_BACKEND=cuda), so the test runs on a one-GPU host too."""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist

from conftest import DEVICE

TIMEOUT_S = 3

_RANK = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import pyep

    rank, store, when, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.group.WORLD
    config = pyep.Config(4, 2, 16, 6, 128)
    buffer = pyep.Buffer(group, config.get_nvl_buffer_size_hint(512, 2), explicitly_destroy=True)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16).to(device)
    topk = torch.randint(0, 8, (64, 2), generator=gen).to(device)
    weights = torch.rand(64, 2, generator=gen).to(device)

    def round_trip():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 8)
        recv, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                        num_tokens_per_expert=per_expert, topk_idx=topk,
                                                        topk_weights=weights, config=config)
        combined, _, _ = buffer.combine(recv, handle, topk_weights=recv_w, config=config)
        if backend == "cuda":
            torch.cuda.synchronize()
        return combined

    round_trip()
    dist.barrier(group)
    if rank == 1:
        if when == "waiting":
            time.sleep(1.0)  # rank 0's dispatch is waiting for this rank by now
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)  # no destroy, no goodbye
    if when == "between":
        time.sleep(1.0)  # rank 1 is gone before this call
    print("STEP calling", flush=True)
    start = time.monotonic()
    try:
        round_trip()
        print("RESULT no error", flush=True)
    except pyep.PyepError as e:
        print(f"RESULT {time.monotonic() - start:.1f}s {e}".replace("\\n", " "), flush=True)
    print("STEP destroying", flush=True)
    start = time.monotonic()
    try:
        buffer.destroy()
        print(f"DESTROY ok {time.monotonic() - start:.1f}s", flush=True)
    except pyep.PyepError as e:
        print(f"DESTROY error {time.monotonic() - start:.1f}s {e}".replace("\\n", " "), flush=True)
    y = torch.arange(1000, device=device)
    print("DEVICE", int((y * 2).sum().item()), flush=True)
    os._exit(0)  # a gloo teardown with a dead peer would wait for it
""")


def _backends():
    yield "cpu"
    if DEVICE == "cuda" and torch.cuda.is_available():
        yield "cuda"


@pytest.mark.parametrize("when", ["between", "waiting"])
@pytest.mark.parametrize("backend", list(_backends()))
def test_peer_dies(group, backend, when):
    """Rank 1 exits between two calls, or is killed while rank 0's dispatch waits for it."""
    if group.rank() == 0:
        env = dict(os.environ, PYEP_BACKEND=backend, PYEP_TIMEOUT_S=str(TIMEOUT_S))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(k, None)
        if backend == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(torch.cuda.current_device())
        store = os.path.join(tempfile.mkdtemp(prefix="pyep-death-"), "store")
        procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), store, when, backend], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        # The dead rank is reaped at once, as torchrun would: a zombie still looks alive to its peers.
        procs[1].communicate(timeout=60)
        try:
            out, err = procs[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            out, err = procs[0].communicate()
            pytest.fail("the survivor did not finish within 60 s:\n" + out + err)
        assert procs[0].returncode == 0, out + err
        lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines() if " " in ln}
        result = lines.get("RESULT", "")
        assert "rank 1" in result and ("timed out" in result or "stopped because" in result), out + err
        assert float(result.split("s ", 1)[0]) < TIMEOUT_S + 10, result
        destroyed = lines.get("DESTROY", "")
        assert destroyed.startswith("ok"), out + err
        # The dead peer's mapping went with its process: destroy does not wait out the timeout for it.
        assert float(destroyed.split()[1].rstrip("s")) < TIMEOUT_S, destroyed
        assert lines.get("DEVICE") == str(999 * 1000), out + err
    dist.barrier(group)
