"""GPT pretraining on Megatron's own training loop (megatron.training.pretrain, which the megatron-core
wheels ship from 0.19 on) and Megatron's mock GPT data, with no Megatron-LM checkout: Megatron-LM's
pretrain_gpt.py (core_r0.19.0) cut down to one tensor- and pipeline-parallel rank (no batch
broadcast, context parallelism, SFT, FIM or ModelOpt). The model comes from Megatron's flags as
there (gpt_config_from_args: the TE decoder-block spec for MoE). Run it through the launcher:

    python -m fp8a2a.megatron.run tests/gpu/pretrain_gpt_mock.py --mock-data --tokenizer-type NullTokenizer \\
        --vocab-size 1024 --num-experts 8 --moe-token-dispatcher-type fp8_alltoall --fp8a2a-experts fp8 ...

On its first forward it prints one line, `fp8a2a-layers: [...]` (JSON): each MoE layer's dispatcher
and experts classes and, for fp8_alltoall, the wire granularity, so a test sees what the flags built."""
import json
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, get_timers, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
_described = False


def describe_moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    layers = []
    for m in model.modules():
        if isinstance(m, MoELayer):
            options = getattr(m.token_dispatcher, "options", None)  # fp8a2a's dispatcher only
            layers.append({"dispatcher": type(m.token_dispatcher).__name__, "experts": type(m.experts).__name__,
                           "granularity": options.dispatcher.granularity if options is not None else None})
    return layers


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    global _described
    if not _described:
        print("fp8a2a-layers: " + json.dumps(describe_moe_layers(model)), flush=True)
        _described = True
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = next(data_iterator)
    batch = {k: batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None for k in KEYS}
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)  # no blend: mock data
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # built on every rank (as pretrain_gpt.py marks its provider)

if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets_provider,
             ModelType.encoder_or_decoder, forward_step)
