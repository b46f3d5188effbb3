"""Low-latency calls captured in CUDA graphs and replayed: one graph per token count (as serving engines capture one
per batch size), replayed many times in mixed order with new inputs each time, the combined tokens bit-exact against
the reference every time. A call's sequence number lives on the device, so a replay is a new call to every peer."""
import pytest
import torch

import pyep
from conftest import BACKEND
from test_low_latency import expert_output, make_inputs, ref_combine

pytestmark = pytest.mark.skipif(BACKEND != "cuda", reason="CUDA graphs need the cuda backend (PYEP_TEST_DEVICE=cuda)")


def test_graphs_of_several_token_counts_replay_in_mixed_order(group, rank, num_ranks):
    R, M, H, K = num_ranks, 8, 256, 3
    E = 2 * R
    L = E // R
    dev = torch.device("cuda", torch.cuda.current_device())
    buffer = pyep.Buffer(group, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                         low_latency_mode=True, explicitly_destroy=True)
    try:
        graphs = {}
        for T in (1, 2, 4, M):
            x = torch.zeros((T, H), dtype=torch.bfloat16, device=dev)
            topk = torch.full((T, K), -1, dtype=torch.int64, device=dev)
            w = torch.zeros((T, K), dtype=torch.float32, device=dev)

            def step():
                recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
                y = torch.stack([expert_output(recv[j], rank * L + j) for j in range(L)])
                return buffer.low_latency_combine(y, topk, w, handle)[0]

            step()  # eager first: the kernels are compiled and loaded outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step()
            graphs[T] = (g, x, topk, w, out)
        for i, T in enumerate([4, 1, M, 2, 2, 4, 1, M, 4, 1, 2, M]):
            inp = make_inputs(100 + i, R, [T] * R, H, E, K)
            g, x, topk, w, out = graphs[T]
            x.copy_(inp.x[rank])
            topk.copy_(inp.topk[rank])
            w.copy_(inp.w[rank])
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), L)), f"replay {i} (tokens {T})"
    finally:
        buffer.destroy()
