"""torchrun --nproc-per-node 2 examples/dispatch_combine.py   # CPU: gloo; GPUs: NCCL, one GPU a rank"""
import torch
import torch.distributed as dist

import fp8a2a

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
torch.manual_seed(rank)
T, H, E, K = 512, 1024, 8, 2  # 1 MiB of BF16 per rank: above bf16_below_bytes (64 KiB), so FP8 crosses
x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
router_logits = torch.randn(T, E, device=device, requires_grad=True)
topk_weights, topk_idx = router_logits.softmax(-1).topk(K, dim=-1)

d = fp8a2a.Dispatcher(num_experts=E, group=dist.group.WORLD)  # granularity="row" (one scale a token)
out = d.dispatch(x, topk_idx, topk_weights)  # each token sent once per rank that holds its experts
assert isinstance(out.tokens, fp8a2a.QuantizedTensor)  # under bf16_below_bytes: a plain BF16 tensor
experts = fp8a2a.FP8GroupedMLP(E // world, H, 2048, device=device)  # this rank's E / world experts
y = d.combine(experts(out.tokens, out.tokens_per_expert), out.handle)  # [T, H]: weighted sum over k
y.float().square().mean().backward()  # gradients reach x, the router and the experts
print(f"rank {rank}: {out.tokens.data.shape[0]} rows of {out.tokens.data.dtype} in, y {tuple(y.shape)}, "
      f"|x.grad| {x.grad.norm():.3g}")
dist.barrier()  # every rank done with its exchanges before any leaves the group
dist.destroy_process_group()
