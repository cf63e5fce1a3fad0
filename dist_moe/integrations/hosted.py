"""What an engine-hosted MoE layer shares with dist-moe's MoELayer: its call signature.

``(y, aux) = layer(x [..., H], categories, token_ids, padding_mask)``: per-token or
per-sequence categories and token ids are flattened as MoELayer does and handed to
the engine's router through ``routing_context``; padding (True in ``padding_mask``) is
left out of the router's statistics, in each engine's own way (DeepSpeed's ``used_token``,
Megatron's ``padding_mask``).
Subclasses say how their engine runs the flat tokens (``_run``) and where their
router and last routing live.
"""
from __future__ import annotations

from torch import Tensor, nn

from dist_moe.integrations.context import routing_context
from dist_moe.moe.host import per_token
from dist_moe.moe.view import expert_locations


class HostedMoE(nn.Module):
    hidden_size: int
    expert_node = None  # [E] each expert's node, when the host was told a topology of several nodes
    expert_rank = None  # [E] each expert's rank, under expert parallelism with a known placement

    def _know_nodes(self, placement, topology) -> None:
        self.expert_node, self.expert_rank = expert_locations(placement, topology)

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def _run(self, tokens: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
        """tokens [T, H], padding [T] bool or None -> (y [T, H], aux loss) through the engine's layer."""
        raise NotImplementedError

    def forward(self, x: Tensor, categories: Tensor | None = None, token_ids: Tensor | None = None,
                padding_mask: Tensor | None = None):
        categories, token_ids = per_token(categories, x.shape, "categories"), per_token(token_ids, x.shape, "token_ids")
        padding = per_token(padding_mask, x.shape, "padding_mask")
        with routing_context(categories=categories, token_ids=token_ids):
            y, aux = self._run(x.reshape(-1, self.hidden_size), padding)
        return y.reshape(x.shape), aux


class DispatchedHost:
    """Mixed into a ``HostedMoE`` whose engine layer (``dispatched``) moves its tokens through dist-moe's
    dispatcher: the layer's topology, placement, dedup and measured bytes, as dist-moe's MoELayer has them."""

    @property
    def dispatched(self):
        raise NotImplementedError

    @property
    def topology(self):
        return self.dispatched.topology

    @property
    def placement(self):
        return self.dispatched.placement

    @property
    def dedup(self) -> str:
        return self.dispatched.dedup

    @property
    def traffic(self):
        return self.dispatched.traffic

    def reset_traffic(self) -> None:
        self.dispatched.reset_traffic()
