#!/usr/bin/env python
"""Train a small GPT with MoE layers, built with megatron-core (local spec, no TransformerEngine),
with FP8 token dispatch: `--moe-token-dispatcher-type fp8_alltoall` (fp8a2a.megatron).

    python examples/train_moe_megatron.py --steps 5 --device cpu          # CPU smoke run (gloo)
    python examples/train_moe_megatron.py --steps 300                      # one GPU
    python examples/train_moe_megatron.py --steps 300 --fp8-experts        # + FP8 expert GEMMs
    torchrun --nproc-per-node 8 examples/train_moe_megatron.py --expert-model-parallel-size 8
    # several nodes (run on every node; 4 nodes x 8 GPUs, experts spread over all 32 GPUs):
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 \
        examples/train_moe_megatron.py --expert-model-parallel-size 32 --num-experts 64 \
        --moe-token-dispatcher-type fp8_alltoall --fp8a2a-granularity row

The data is synthetic (each sequence follows a fixed random successor table, different data on
every rank), so the loss falls quickly from log(vocab). Gradients are averaged by hand: dense
parameters over the data-parallel group, expert parameters over the expert-data-parallel group.
Compare against --moe-token-dispatcher-type alltoall on GPU (Megatron's alltoall needs CUDA) or
allgather.
"""
import argparse
import datetime
import math
import os
import time
import warnings

import torch
import torch.distributed as dist

import fp8a2a.megatron as fm

try:
    import megatron.core  # noqa: E402,F401
except ImportError:
    sys.exit("train_moe_megatron.py needs megatron-core: pip install --no-deps megatron-core==0.16.1 (tested on "
             "CPU; 0.19.2 on GPUs), or bash scripts/install.sh --test")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe-token-dispatcher-type", default="fp8_alltoall",
                   choices=["allgather", "alltoall", "flex", fm.FP8_ALLTOALL])
    fm.add_arguments(p)  # --fp8a2a-* flags (and fp8_alltoall in the choices above)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    p.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--fp8-experts", action="store_true", help="FP8 expert GEMMs (fp8a2a.megatron.fp8_experts_spec)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 parameters and activations (default: on for cuda, off for cpu)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=10)
    a = p.parse_args(argv)
    if a.bf16 is None:
        a.bf16 = a.device == "cuda"
    return a


def init_distributed(device):
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    else:  # one process
        from fp8a2a.megatron.standalone import single_process_group
        single_process_group(backend, timeout=datetime.timedelta(minutes=10))


def build_model(a):
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from fp8a2a.megatron.standalone import cpu_current_device, with_portable_router

    cpu = a.device == "cpu"
    if cpu:
        cpu_current_device()
    ps.initialize_model_parallel(expert_model_parallel_size=a.expert_model_parallel_size,
                                 create_gloo_process_groups=False)
    # CPU: an RNG tracker without CUDA states (dropout uses the default generator)
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed, inference_rng_tracker=cpu)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
        moe_token_dispatcher_type=a.moe_token_dispatcher_type, moe_aux_loss_coeff=a.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss", moe_expert_capacity_factor=a.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=a.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        expert_model_parallel_size=a.expert_model_parallel_size, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, bf16=a.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=cpu, init_method_std=0.02)
    for name in fm.options.NAMES:  # the --fp8a2a-* flags given (None = not given)
        value = getattr(a, "fp8a2a_" + name)
        if value is not None:
            setattr(config, "fp8a2a_" + name, value)
    spec = get_gpt_layer_local_spec(num_experts=a.num_experts, moe_grouped_gemm=False)
    # megatron-core 0.16 without TransformerEngine cannot run its router's gating (CUDA move,
    # te_general_gemm): use a plain-torch gating, Megatron's routing otherwise
    spec = with_portable_router(spec)
    if a.fp8_experts:
        spec = fm.fp8_experts_spec(spec)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=a.vocab_size,
                     max_sequence_length=a.seq_length, position_embedding_type="rope")
    model.to(device=a.device, dtype=dtype)
    return model, config


def batch(a, step, table, device):
    g = torch.Generator().manual_seed(a.seed * 1000003 + step * 131 + dist.get_rank())
    start = torch.randint(0, a.vocab_size, (a.micro_batch_size, 1), generator=g)
    toks = [start]
    for _ in range(a.seq_length):
        toks.append(table[toks[-1]])
    seq = torch.cat(toks, 1)
    noise = torch.rand(seq.shape, generator=g) < 0.05  # a little unpredictability
    seq = torch.where(noise, torch.randint(0, a.vocab_size, seq.shape, generator=g), seq)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def sync_grads(model):
    from megatron.core import parallel_state as ps
    groups = {True: ps.get_data_parallel_group(), False: ps.get_expert_data_parallel_group()}
    for p in model.parameters():
        if p.grad is None:
            continue
        group = groups[getattr(p, "allreduce", True)]
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)


def main(argv=None):
    a = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|moe_ffn_hidden_size).*")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu)")
    fm.register()
    init_distributed(a.device)
    torch.manual_seed(a.seed)
    model, config = build_model(a)
    rank0 = dist.get_rank() == 0
    disp = model.decoder.layers[0].mlp.token_dispatcher
    if rank0:
        n = sum(p.numel() for p in model.parameters())
        print(f"megatron-core GPT: {a.num_layers} layers, {a.num_experts} experts top-{a.moe_router_topk}, {n} "
              f"params on this rank; dispatcher {type(disp).__name__}"
              + (f" ({disp.options})" if hasattr(disp, "options") else "")
              + f"; experts {type(model.decoder.layers[0].mlp.experts).__name__}; world {dist.get_world_size()}",
              flush=True)
    table = torch.randperm(a.vocab_size, generator=torch.Generator().manual_seed(a.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95),
                            eps=1e-6 if a.bf16 else 1e-8)
    mask = torch.triu(torch.ones(a.seq_length, a.seq_length, dtype=torch.bool, device=a.device), 1)[None, None]
    pos = torch.arange(a.seq_length, device=a.device)[None].expand(a.micro_batch_size, -1)
    first = last = None
    t0 = time.time()
    for step in range(1, a.steps + 1):
        tokens, labels = batch(a, step, table, a.device)
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        sync_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.detach()
        dist.all_reduce(value)
        value = value.item() / dist.get_world_size()
        if not math.isfinite(value):
            raise SystemExit(f"step {step}: loss is {value}")
        first = value if first is None else first
        last = value
        if rank0 and (step % a.log_interval == 0 or step == 1 or step == a.steps):
            print(f"step {step:5d}  loss {value:.4f}  {(time.time() - t0) / step * 1e3:.0f} ms/step", flush=True)
    if rank0:
        print(f"done: loss {first:.4f} -> {last:.4f} in {a.steps} steps "
              f"(ln(vocab) = {math.log(a.vocab_size):.2f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return first, last


if __name__ == "__main__":
    main()
