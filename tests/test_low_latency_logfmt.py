"""low_latency_combine(use_logfmt=True): the rows cross in LogFMT-10 (docs/low-latency.md, "LogFMT"), each (token,
rank) row encoded by its sender and decoded before the sum. The reference reads the format's rule independently of
goep/lowlatency/logfmt.go and kernels/low_latency_combine.cuh: the combine must equal the bf16 reference with every
crossing row passed through it, bit for bit, on both backends."""
import pytest
import torch

import pyep
from conftest import BACKEND
from test_low_latency import EXPERTS_PER_RANK, dev, dispatch, expert_outputs, make_inputs, ref_combine

LEVELS, CLIP, INF = 509, 32 * 128, 0x7f80


def logfmt_round(row: torch.Tensor) -> torch.Tensor:
    """A bf16 row as it arrives in LogFMT-10: per group of 128 channels, the magnitudes' bit patterns m between the
    least non-zero finite one (raised to 32 octaves below the largest) and the largest finite one, quantized to 509
    steps; below the range the least level within an octave of it, else zero; infinities and NaNs as infinities."""
    bits = (row.view(torch.int16).to(torch.int32) & 0xffff).tolist()
    out = []
    for g in range(0, len(bits), 128):
        group = bits[g:g + 128]
        finite = [b & 0x7fff for b in group if b & 0x7fff < INF]
        bmax = max(finite, default=0)
        bmin = min([m for m in finite if m], default=0)
        bmin = max(bmin, bmax - CLIP) if bmax - bmin > CLIP else bmin
        d = bmax - bmin
        for b in group:
            m, sign = b & 0x7fff, b & 0x8000
            if m >= INF:
                n = INF
            elif m == 0 or m + 128 < bmin:
                n = 0
            elif m < bmin:
                n = bmin
            elif d == 0:
                n = bmin
            else:
                c = ((m - bmin) * 2 * LEVELS + d) // (2 * d)
                n = bmin + (c * d * 2 + LEVELS) // (2 * LEVELS)
            out.append(sign | n)
    return torch.tensor(out, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.fixture(scope="module", params=["nvlink", "puts"])
def buffer(group, request):
    """The buffer of one node, and one whose peers are all written through the put/signal path
    (allow_nvlink_for_low_latency_mode=False: on cuda NVSHMEM's, which the emulator's TestEmulatedLowLatencyLogFMT
    runs, so it is the cpu backend's here)."""
    if request.param == "puts" and BACKEND != "cpu":
        pytest.skip("the put path on cuda is NVSHMEM's: goep/cuda/emu's TestEmulatedLowLatencyLogFMT runs LogFMT rows "
                    "through it")
    R = group.size()
    size = pyep.Buffer.get_low_latency_rdma_size_hint(8, 384, R, EXPERTS_PER_RANK * R)
    buffer = pyep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=EXPERTS_PER_RANK,
                         explicitly_destroy=True, allow_nvlink_for_low_latency_mode=request.param == "nvlink")
    yield buffer
    buffer.destroy()


def test_reference_reads_the_rule():
    one_octave = torch.tensor([(64 + i) * (-1) ** i for i in range(128)], dtype=torch.float32).bfloat16()
    assert torch.equal(logfmt_round(one_octave), one_octave)  # within 509 steps: exact
    wide = (torch.randn(128, generator=torch.Generator().manual_seed(0)) * 2 ** torch.arange(-8, 8, 0.125)).bfloat16()
    got = logfmt_round(wide)
    rel = ((got.float() - wide.float()).abs() / wide.float().abs()).max().item()
    assert 0 < rel < 0.04 and torch.equal(got.float().sign(), wide.float().sign())


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("H,K", [(128, 2), (384, 4)])
def test_combine_logfmt(buffer, rank, num_ranks, hook, H, K):
    R, E, M = num_ranks, EXPERTS_PER_RANK * num_ranks, 8
    buffer.clean_low_latency_buffer(M, H, E)
    for seed in range(2):  # both halves
        inp = make_inputs(seed + 40, R, [M] * R, H, E, K)
        recv, _, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
        y = expert_outputs(recv, handle, rank, E, R)
        out = torch.empty((M, H), dtype=torch.bfloat16, device=dev())
        combined, _, recv_hook = buffer.low_latency_combine(y, inp.topk[rank].to(dev()), inp.w[rank].to(dev()), handle,
                                                            use_logfmt=True, return_recv_hook=hook, out=out)
        if hook:
            recv_hook()
        assert combined is out
        out = out.cpu()
        want = ref_combine(inp, rank, set(), E // R, crossing=logfmt_round)
        assert torch.equal(out, want)
        plain = ref_combine(inp, rank, set(), E // R)
        assert not torch.equal(out, plain)  # randn rows span more than 4 octaves: some values moved
        assert ((out.float() - plain.float()).abs() <= 0.08 * plain.float().abs() + 1e-2).all()
