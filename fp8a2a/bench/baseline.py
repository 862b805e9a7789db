"""The benchmarks' BF16 baseline: megatron-core's `alltoall` dispatcher (unfused path, no TP,
dropless) in plain torch, and the uniform random routing every benchmark feeds both sides."""
import torch
import torch.distributed as dist

def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd (Megatron's _AllToAll)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(g.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def _all_gather_flat(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, inp, group=group)


class MegatronStyleAlltoAll:
    """What megatron-core's MoEAlltoAllTokenDispatcher does (no TP, dropless, moe_permute_fusion
    off), op for op: tokens-per-expert all-gather, one host sync, permute (masked_select +
    index_select, one copy of a token per expert), all_to_all_single of tokens and of probs,
    sort_chunks_by_idxs to expert-major order (split + cat); combine: the reverse and an
    unpermute (scatter_add). At world size 1 the collectives are skipped, as Megatron does.
    Differentiable (used by the MoE-layer benchmark too).

    dispatch(x [T, H], routing_map bool [T, E], probs [T, E]) -> (rows [N, H] expert-major,
    tokens_per_expert (host int64 [local]), probs [N]); combine(rows [N, H], apply_probs=False) -> [T, H]."""

    def __init__(self, num_experts: int, group=None):
        self.group = group
        self.rank, self.world = _group_info(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} is not a multiple of the group size {self.world}")
        self.num_experts, self.local = num_experts, num_experts // self.world
        idx = torch.arange(num_experts)
        self.sort_input = idx.reshape(-1, self.local).T.ravel().tolist()
        self.restore_output = idx.reshape(self.local, -1).T.ravel().tolist()

    def dispatch(self, x, routing_map, probs):
        T, E, L = x.shape[0], self.num_experts, self.local
        per_expert = routing_map.sum(0).long()  # [E]
        if self.world > 1:
            in_splits = per_expert.reshape(self.world, L).sum(1)
            every = per_expert.new_empty(self.world * E)
            _all_gather_flat(every, per_expert, self.group)
            chunks = every.view(self.world, E)[:, self.rank * L:(self.rank + 1) * L]  # [world, L]
            out_splits = chunks.sum(1)
            tpe = chunks.sum(0)
            host = torch.cat([in_splits, out_splits, chunks.reshape(-1), tpe]).cpu()  # the host sync
            w = self.world
            self.in_splits, self.out_splits = host[:w].tolist(), host[w:2 * w].tolist()
            self.chunks = host[2 * w:2 * w + w * L].view(w, L)
            tpe_host = host[2 * w + w * L:]
        else:
            tpe_host = per_expert.cpu()
            self.chunks = tpe_host.view(1, E)
        rmap = routing_map.T.contiguous()  # [E, T]
        self.sorted_indices = torch.arange(T, device=x.device).unsqueeze(0).expand(E, -1).masked_select(rmap)
        self.permuted_probs = probs.T.contiguous().masked_select(rmap)
        self.shape = x.shape
        rows = x.index_select(0, self.sorted_indices)
        p = self.permuted_probs
        if self.world > 1:
            rows = _AllToAll.apply(rows, self.out_splits, self.in_splits, self.group)
            p = _AllToAll.apply(p, self.out_splits, self.in_splits, self.group)
        if L > 1:
            sizes = self.chunks.reshape(-1).tolist()
            rows_parts, p_parts = torch.split(rows, sizes), torch.split(p, sizes)  # split once: E*R views
            rows = torch.cat([rows_parts[i] for i in self.sort_input])
            p = torch.cat([p_parts[i] for i in self.sort_input])
        return rows, tpe_host, p

    def combine(self, rows, apply_probs: bool = False):
        if self.local > 1:
            sizes = self.chunks.T.reshape(-1).tolist()
            parts = torch.split(rows, sizes)
            rows = torch.cat([parts[i] for i in self.restore_output])
        if self.world > 1:
            rows = _AllToAll.apply(rows, self.in_splits, self.out_splits, self.group)
        dtype = rows.dtype
        if apply_probs:
            rows = rows * self.permuted_probs.unsqueeze(-1)
        out = torch.zeros(self.shape, dtype=rows.dtype, device=rows.device)
        out = out.scatter_add(0, self.sorted_indices.unsqueeze(1).expand(-1, self.shape[1]), rows)
        return out.to(dtype)

    def wire_bytes(self, hidden: int, elem: int = 2, prob_bytes: int = 4):
        """(dispatch, combine) bytes this rank sends: tokens + probs (+ the counts all-gather)."""
        rows = sum(self.in_splits) if self.world > 1 else int(self.chunks.sum())
        counts = self.num_experts * 8 * self.world if self.world > 1 else 0
        return rows * (hidden * elem + prob_bytes) + counts, rows * hidden * elem


def make_routing(tokens: int, experts: int, topk: int, device, seed: int):
    """Uniform random top-k routing: (topk_idx int64 [T, K], topk_weights f32 [T, K],
    routing_map bool [T, E], probs f32 [T, E])."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    val, idx = scores.topk(topk, dim=1)
    w = torch.softmax(val, dim=1)
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.zeros(tokens, experts).scatter_(1, idx, w)
    return idx.to(device), w.to(device), rmap.to(device), probs.to(device)
