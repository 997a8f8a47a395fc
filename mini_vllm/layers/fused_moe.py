"""A Mixture-of-Experts MLP: a router picks `top_k` of `E` SwiGLU experts per token.

Every expert's weights live in two stacked tensors, as vLLM's `FusedMoE` keeps
them: `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I]` (its down projection). A token's output is the routing-weighted
sum of its experts' outputs:

    x [T, H] ── router ──► probs [T, E] ── top_k ──► weights [T, k], ids [T, k]
    y[t] = sum_j  weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]

The reference visits each expert that some token chose and runs its tokens
as one batch (Hugging Face's loop). The fast path sorts the `T * k`
(token, expert) rows by expert and multiplies every expert's rows by its
weights in one grouped GEMM per projection, with no host synchronisation,
so a CUDA graph can hold it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.layers.custom_op import CustomOp


def _grouped_mm_fn():
    """PyTorch's grouped GEMM (`F.grouped_mm`, or `torch._grouped_mm` before it), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# --8<-- [start:select_experts]
def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, the `top_k` most probable per token.

    Args:
        router_logits: `[T, E]`.
        top_k: experts per token.
        renormalize: rescale each token's `top_k` probabilities to sum to 1
            (Qwen3-MoE's `norm_topk_prob`).

    Returns:
        `(weights [T, k]` in the logits' dtype, `ids [T, k]` int64), most probable first.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids
# --8<-- [end:select_experts]


class FusedMoE(CustomOp):
    """The `E` experts of one MoE layer and how tokens are routed to them.

    Args:
        num_experts: `E`.
        top_k: experts per token.
        hidden_size: `H`.
        intermediate_size: `I`, each expert's MLP width.
        renormalize: see `select_experts`.
        device: where to allocate the weights (uninitialised until loaded).
        dtype: the weights' dtype.

    Attributes:
        w13: `[E, 2I, H]`: expert `e`'s gate_proj in rows `[0, I)`, up_proj in `[I, 2I)`.
        w2: `[E, H, I]`: expert `e`'s down_proj.
        grouped: the fast path multiplies through PyTorch's grouped GEMM (else it
            loops over the experts; set with the implementation).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.grouped = False
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                            device=device, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                           device=device, dtype=dtype), requires_grad=False)

    # --8<-- [start:targets]
    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Where each expert's checkpoint tensors go: views of the stacked weights.

        `{prefix}.{e}.gate_proj.weight` -> `w13[e, :I]`, `up_proj` -> `w13[e, I:]`,
        `down_proj` -> `w2[e]` (the loader calls this for `prefix` = this module's name).
        """
        inter, targets = self.intermediate_size, {}
        for e in range(self.num_experts):
            targets[f"{prefix}.{e}.gate_proj.weight"] = self.w13.data[e, :inter]
            targets[f"{prefix}.{e}.up_proj.weight"] = self.w13.data[e, inter:]
            targets[f"{prefix}.{e}.down_proj.weight"] = self.w2.data[e]
        return targets
    # --8<-- [end:targets]

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can hold this block: only the grouped GEMM path runs
        without reading the routing on the host."""
        return self.use_fast and self.grouped

    # --8<-- [start:forward_native]
    def forward_native(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """`[T, H]` hidden states, `[T, E]` router logits -> `[T, H]`."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # the experts some token chose (a host sync)
            tokens, slot = torch.where(ids == e)  # token t chose e as its slot-th expert
            gate, up = F.linear(x[tokens], self.w13[e]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, self.w2[e])  # [n, H]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out
    # --8<-- [end:forward_native]

    def fast_supported(self, device: torch.device, dtype: torch.dtype) -> bool:
        # PyTorch's grouped GEMM runs bfloat16 on Ampere and later; elsewhere the
        # fast path is the sorted loop (which reads the expert counts on the host).
        self.grouped = (device.type == "cuda" and dtype == torch.bfloat16
                        and _grouped_mm_fn() is not None
                        and torch.cuda.get_device_capability(device) >= (8, 0))
        return device.type == "cuda"

    # --8<-- [start:forward_fast]
    def forward_fast(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The same function over the `T * k` (token, expert) rows sorted by expert:

            rows (token, expert):  (0,5) (0,1) (1,1) (1,7) (2,5) (2,1)      T = 3, k = 2
            sorted by expert:      (0,1) (1,1) (2,1) | (0,5) (2,5) | (1,7)
            offsets (ends):                        3             5       6
            grouped GEMM:          rows [0, 3) x expert 1, [3, 5) x expert 5, ...

        then each row is weighted and added back into its token's output.
        """
        k = self.top_k
        weights, ids = select_experts(router_logits, k, self.renormalize)
        flat = ids.reshape(-1)  # [T * k], row r = (token r // k, its (r % k)-th expert)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert
        tokens = order // k  # [T * k] the token of each sorted row
        # Where each expert's rows end, computed on the device: no sync.
        bounds = torch.arange(1, self.num_experts + 1, device=x.device, dtype=flat.dtype)
        offsets = torch.searchsorted(flat[order], bounds, right=False).to(torch.int32)  # [E]
        xs = x[tokens]  # [T * k, H]
        h = self._experts_mm(xs, self.w13, offsets)  # [T * k, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = self._experts_mm(F.silu(gate) * up, self.w2, offsets)  # [T * k, H]
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y)
    # --8<-- [end:forward_fast]

    def _experts_mm(self, rows: torch.Tensor, w: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
        """`rows[offsets[e-1]:offsets[e]] @ w[e].T` for every expert `e`, stacked."""
        if self.grouped:
            # w[e] is [out, in]; the grouped GEMM takes [E, in, out] (a transposed view).
            return _grouped_mm_fn()(rows, w.transpose(1, 2), offs=offsets)
        out = rows.new_empty(rows.shape[0], w.shape[1])
        start = 0
        for e, end in enumerate(offsets.tolist()):  # one host sync for all the experts
            if end > start:
                out[start:end] = F.linear(rows[start:end], w[e])
            start = end
        return out


__all__ = ["FusedMoE", "select_experts"]
