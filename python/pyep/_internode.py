"""DeepEP V1's internode normal mode on Buffer (NVLink within a domain, RDMA between domains), which `dispatch`
and `combine` call when the group spans NVLink domains. Not implemented yet: each method raises
`pyep.NotAvailableError` naming itself, before it looks at its arguments."""
from typing import List, Optional, Tuple, Union

import torch

from ._core import not_available
from .config import Config
from .utils import EventOverlap

_INTERNODE = "normal mode across NVLink domains (internode, over RDMA)"


def nodes_hint(runtime) -> str:
    """What an error about a mode that does not run across nodes adds when PYEP_RANKS_PER_NODE made the nodes."""
    k = runtime.ranks_per_node
    if not k:
        return ""
    hint = (f"the {runtime.num_ranks} ranks are {runtime.get_num_rdma_ranks()} nodes because PYEP_RANKS_PER_NODE={k} "
            "(read when the Buffer was made)")
    return hint + (": unset it to run them as one node" if runtime.num_ranks <= 8 else "")


def tokens_per_node(topk_idx: torch.Tensor, num_experts: int, num_nodes: int) -> torch.Tensor:
    """get_dispatch_layout's num_tokens_per_rdma_rank: `[num_nodes]` int32, the tokens with at least one of their top-k
    experts on each node (a token counts once for a node however many of its ranks it goes to). Computed from topk_idx
    on the caller's stream, where topk_idx is ready."""
    T = topk_idx.size(0)
    node = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_nodes), num_nodes)  # num_nodes: no expert
    hit = torch.zeros((T, num_nodes + 1), dtype=torch.bool, device=topk_idx.device).scatter_(1, node, True)
    return hit[:, :num_nodes].sum(0, dtype=torch.int32)


class InternodeMixin:
    """Buffer's internode methods (see the module's docstring)."""

    def internode_dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                           handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """
        The dispatch of a group that spans NVLink domains: tokens cross between domains over RDMA (to the rank with
        the same index in the destination domain), then within it over NVLink. `dispatch` calls it; callers need not.

        Arguments and returns are those of `dispatch`, without `num_worst_tokens`; `num_tokens_per_rdma_rank`
        (`[num_rdma_ranks]` with `torch.int`, from `get_dispatch_layout`) is required, `config` must be set, and the
        handle is internode's own 10-tuple.
        """
        raise not_available("internode_dispatch", _INTERNODE, nodes_hint(self.runtime))

    def internode_combine(self, x: torch.Tensor, handle: Union[tuple, list],
                          topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                          config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """
        The combine of a group that spans NVLink domains (the reverse path of `internode_dispatch`). `combine`
        calls it; callers need not.

        Arguments and returns are those of `combine`; `config` must be set and `handle` is `internode_dispatch`'s.
        """
        raise not_available("internode_combine", _INTERNODE, nodes_hint(self.runtime))
