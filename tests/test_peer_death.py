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

    rank, store, when, backend, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.group.WORLD
    config = pyep.Config(4, 2, 16, 6, 128)
    M, E = 64, 8
    if mode == "normal":
        buffer = pyep.Buffer(group, config.get_nvl_buffer_size_hint(512, 2), explicitly_destroy=True)
    else:  # low-latency mode, the two ranks two nodes (PYEP_RANKS_PER_NODE=1: over NVSHMEM on cuda)
        buffer = pyep.Buffer(group, 0, pyep.Buffer.get_low_latency_rdma_size_hint(M, 256, 2, E), low_latency_mode=True,
                             explicitly_destroy=True)
        assert buffer.runtime.get_num_rdma_ranks() == 2
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16).to(device)
    topk = torch.rand(64, E, generator=gen).topk(2, dim=1).indices.to(device)  # two distinct experts a token
    weights = torch.rand(64, 2, generator=gen).to(device)

    def round_trip():
        if mode == "normal":
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
            recv, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                            num_tokens_per_expert=per_expert, topk_idx=topk,
                                                            topk_weights=weights, config=config)
            combined, _, _ = buffer.combine(recv, handle, topk_weights=recv_w, config=config)
        else:
            recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
            combined, _, _ = buffer.low_latency_combine(recv, topk, weights, handle)
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
        if mode != "normal":
            round_trip()  # on cuda a low-latency timeout is raised by the buffer's next call (kernels never block the host)
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
@pytest.mark.parametrize("mode", ["normal", "ll-nodes"])
def test_peer_dies(group, backend, when, mode):
    """Rank 1 exits between two calls, or is killed while rank 0's dispatch waits for it; in normal mode, and in
    low-latency mode with the two ranks as two nodes (PYEP_RANKS_PER_NODE=1: on cuda over NVSHMEM, whose collective
    free cannot finish without the dead peer: destroy leaves the region allocated, says that this process's NVSHMEM is
    left unusable, and the GPU stays usable)."""
    if group.rank() == 0:
        env = dict(os.environ, PYEP_BACKEND=backend, PYEP_TIMEOUT_S=str(TIMEOUT_S))
        nvshmem = mode == "ll-nodes" and backend == "cuda"
        env.pop("PYEP_RANKS_PER_NODE", None)  # the case's own, below
        if mode == "ll-nodes":
            env.update(PYEP_RANKS_PER_NODE="1", NVSHMEM_REMOTE_TRANSPORT="none", NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(k, None)
        if backend == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(torch.cuda.current_device())
        store = os.path.join(tempfile.mkdtemp(prefix="pyep-death-"), "store")
        procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), store, when, backend, mode], env=env,
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
        if nvshmem and "needs NVSHMEM" in result:
            pytest.skip(f"NVSHMEM does not run here: {result}")
        assert "rank 1" in result and any(w in result for w in ("timed out", "stopped because", "did not answer")), out + err
        assert float(result.split("s ", 1)[0]) < TIMEOUT_S + 10, result
        destroyed = lines.get("DESTROY", "")
        if nvshmem:
            # nvshmem_free is collective and the peer is known to have failed: the region is left, at once.
            assert destroyed.startswith("error") and "was not freed, since a peer failed" in destroyed, out + err
            assert float(destroyed.split()[1].rstrip("s")) < TIMEOUT_S, destroyed
        else:
            assert destroyed.startswith("ok"), out + err
            # The dead peer's mapping went with its process: destroy does not wait out the timeout for it.
            assert float(destroyed.split()[1].rstrip("s")) < TIMEOUT_S, destroyed
        assert lines.get("DEVICE") == str(999 * 1000), out + err
    dist.barrier(group)
