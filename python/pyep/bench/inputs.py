"""The inputs of a case: DeepEP's tests' routing and data, per rank."""
from typing import Tuple

import torch


def make_routing(tokens: int, experts: int, topk: int, rank: int, seed: int, mask_ratio: float,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random top-k as DeepEP's tests route: scores = |randn| + 1, the top-k largest (unsorted); optionally a
    fraction of the choices masked to -1. Returns topk_idx [T, K] int64 and topk_weights [T, K] float32."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 7919 + tokens * 31 + experts * 17 + topk)
    scores = torch.randn((tokens, experts), generator=g, device=device).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=-1, largest=True, sorted=False).indices
    if mask_ratio > 0:
        topk_idx.masked_fill_(torch.rand((tokens, topk), generator=g, device=device) < mask_ratio, -1)
    topk_weights = torch.rand((tokens, topk), generator=g, device=device)
    return topk_idx.contiguous(), topk_weights


def make_x(tokens: int, hidden: int, rank: int, seed: int, device: torch.device):
    """x [T, H] BF16, and its FP8 form as DeepEP's tests make it (per 128 columns: e4m3 values and float32
    scales [T, H/128]); the FP8 pair is None when hidden is not a multiple of 128."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 7919 + tokens * 13 + hidden + 1)
    x = torch.randn((tokens, hidden), generator=g, device=device, dtype=torch.float32)
    fp8 = None
    if hidden % 128 == 0:
        blocks = x.view(tokens, hidden // 128, 128)
        amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
        fp8 = ((blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(tokens, hidden),
               (amax / 448.0).contiguous())
    return x.to(torch.bfloat16), fp8
