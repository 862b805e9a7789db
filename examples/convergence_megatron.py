#!/usr/bin/env python
"""Convergence of fp8_alltoall in the setting users run: a megatron-core GPTModel whose MoE layers
come from Megatron's TransformerEngine spec (TEGroupedMLP experts, fine-grained: 16 experts top-4,
d_model 512, 4 layers), every arm trained under TE's FP8 blockwise recipe (Megatron's fp8="e4m3",
fp8_recipe="blockwise", moe_router_padding_for_quantization). Arms of one seed:

  A      bf16                alltoall (Megatron's; BF16 on the wire)
  B      fp8_row             fp8_alltoall, row scales
  C      fp8_block128        fp8_alltoall, one scale per 128 values
  D      fp8_experts         fp8_alltoall (row) + fp8a2a.megatron.fp8_experts_spec
  E      fp8_experts_dgrad   D with FP8 input-gradient GEMMs (fp8a2a_fp8_dgrad)
  F      fp8_experts_dgrad_wgrad   E with FP8 weight-gradient GEMMs too (fp8a2a_fp8_wgrad)
  G      fp8_row_combine     B with the combine forward in FP8 (fp8a2a_fp8_combine)
  H      fp8_row_dispatch_bwd  B with the dispatch backward in FP8 (fp8a2a_fp8_dispatch_backward)
  noise  bf16_order2         A with a second data order: the run-to-run noise floor
  rerun  bf16_rerun          A again: differs from A only where the kernels are nondeterministic

A seed sets the initialization (every arm of a seed copies the weights of one reference model built
from it) and the data order (byte windows of the Python standard library's .py files, the corpus of
examples/train_convergence.py; the noise arm draws a second order). The FP8 arms force FP8 on the
wire at world size 1 (fp8a2a_bf16_below_bytes=0): the dispatcher still quantizes, packs and unpacks.
Weights are BF16 on the GPU with FP32 master copies in AdamW (what Megatron's mixed-precision
optimizer does); cosine schedule with warmup.

Per seed, DIR gets convergence.csv (run,step,train_loss,val_loss; runs <arm name>_seed<N>; train_loss
the mean since the previous log, val_loss a fixed held-out subset, nats per byte), summary.json (per
run: the final loss on the whole held-out split, ms/step, fp8_wire: the FP8 arms really sent FP8
rows, te_fp8: TE's FP8 autocast was on, with its recipe) and summary.txt.

  python examples/convergence_megatron.py --seed 1 --out out/seed1                 # one H200, 6 arms
  python examples/convergence_megatron.py --seed 1 --arms A,B,C --out out/s1a --time-budget 540
  python examples/convergence_megatron.py --seed 1 --jobs 3 --out out/seed1        # arms in 3 processes
  python examples/convergence_megatron.py --device cpu --tiny --steps 10 --arms A,B,noise --out /tmp/c
  python examples/convergence_megatron.py --merge out/seed1 out/s1a ... --out results

--merge: dirs of the same seed may hold different arms (a seed split over sessions); per arm, the
per-seed gaps of the final validation loss against arm A of the same seed, their mean and 95%
t-interval over seeds, next to the noise floor's (bf16_order2 against bf16); the targets (issue 20)
are evaluated, never assumed: B and C |mean gap| <= 0.25% and the 95% interval inside +-0.5%, no
seed's |gap| above twice the noise floor's largest; D and E reported against the same bounds.
Writes convergence.csv, convergence_summary.json, convergence_summary.txt, convergence.png. The
statistics and the report are examples/convergence_stats.py's (with ARMS, the table above): merging
needs no GPU, Megatron or TE. --at-step N adds the same table as of step N, from the logged validation
loss (the fixed held-out subset), where a run the deadline cut at or after step N counts too.

--time-budget SEC: every arm is timed for a few steps first; arms are trained in order (A first)
while their estimated time fits, the others are listed in summary.json as skipped (run them in
another session with the same --seed and --steps, then merge). A process with one arm (each --jobs
process when jobs >= arms) skips the timing and trains while one more log interval and the final
evaluation still fit; a run the deadline cuts is marked truncated and left out of the gaps. The --jobs
processes share the command's deadline.

--checkpoint-dir DIR: a run the deadline cuts saves its state there (weights, FP32 masters, AdamW,
its rows so far), and a finished run its result; the same command again continues each cut run
where it stopped and returns each finished one without training. Runs longer than one device call
then take several calls (keep DIR on the machine between them, and the same --seed, --steps and
sizes). --device cpu --tiny: the local spec,
no TE and no FP8 recipe (Megatron's alltoall needs CUDA: arm A uses allgather there), tiny sizes; a
functional smoke only.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
import types
import warnings

import torch

import fp8a2a
import fp8a2a.megatron as fm
from fp8a2a import invalidate_fp8_weight_cache
# the sibling examples (a script's own directory is on sys.path)
from train_convergence import Batches, load_corpus, lr_at, read_csv, step_seconds, sync, write_csv
from convergence_stats import ARMS, MIN_STEPS, gap, merge, pct, run_name

DEFAULT_ARMS = "A,B,C,D,E,noise"


# ---------------------------------------------------------------------------------------------
# model


def model_config(a):
    cpu = a.device == "cpu"
    d = dict(layers=4, hidden=512, heads=8, experts=16, topk=4, moe_ffn=256, shared_expert=0, seq=512, batch=8,
             lr=1e-3, warmup=100, min_lr_frac=0.1, weight_decay=0.1, grad_clip=1.0, aux_coef=1e-2, log_every=100,
             val_seqs=64, val_full_max=4096)
    if a.tiny:
        d.update(layers=2, hidden=128, heads=4, experts=4, topk=2, moe_ffn=64, seq=32, batch=4, lr=3e-3, warmup=5,
                 log_every=5, val_seqs=8, val_full_max=16)
    for k in d:
        v = getattr(a, k, None)
        if v is not None:
            d[k] = v
    d.update(te=not cpu and not a.local_spec, fp8_recipe=None if cpu or a.fp8_recipe == "none" else a.fp8_recipe,
             bf16=(not cpu) if a.bf16 is None else a.bf16, vocab=256)
    return types.SimpleNamespace(**d)


def build_model(cfg, arm, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig
    from fp8a2a.megatron.standalone import with_portable_router

    name, dispatcher, opts, fp8_experts, _ = ARMS[arm]
    cpu = device.type == "cpu"
    if dispatcher == "alltoall" and cpu:
        dispatcher = "allgather"  # megatron-core's alltoall makes CUDA streams
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    kw = dict(num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
              ffn_hidden_size=cfg.moe_ffn, moe_ffn_hidden_size=cfg.moe_ffn, num_moe_experts=cfg.experts,
              moe_router_topk=cfg.topk, moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=cfg.aux_coef,
              moe_router_load_balancing_type="aux_loss", moe_router_dtype="fp32", moe_grouped_gemm=cfg.te,
              moe_permute_fusion=cfg.te, moe_shared_expert_intermediate_size=cfg.shared_expert or None,
              gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
              normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, bf16=cfg.bf16, params_dtype=dtype,
              pipeline_dtype=dtype, use_cpu_initialization=cpu, init_method_std=0.02)
    if cfg.fp8_recipe:
        kw.update(fp8="e4m3", fp8_recipe=cfg.fp8_recipe, moe_router_padding_for_quantization=True)
    config = TransformerConfig(**kw)
    if dispatcher == fm.FP8_ALLTOALL:
        # FP8 on the wire even at world size 1; the experts named (the recipe would pick the FP8 ones)
        for k, v in {"bf16_below_bytes": 0, "experts": "fp8" if fp8_experts else "megatron", **opts}.items():
            setattr(config, "fp8a2a_" + k, v)
    if cfg.te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.experts, moe_grouped_gemm=True)
    else:
        spec = with_portable_router(specs.get_gpt_layer_local_spec(num_experts=cfg.experts, moe_grouped_gemm=False))
    if fp8_experts:
        spec = fm.fp8_experts_spec(spec)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab, max_sequence_length=cfg.seq,
                     position_embedding_type="rope")
    return model.to(device=device, dtype=dtype), config, dispatcher


def data_order(train_t, val_t, cfg, seed, order, steps, device, **held_out):
    """Batches of data order `order` (an arm's ARMS entry) of `seed`; held_out: val_seqs and
    val_full_max other than cfg's."""
    ns = types.SimpleNamespace(data_seed=1000003 * seed + order, seq=cfg.seq, batch=cfg.batch,
                               **{k: held_out.get(k, getattr(cfg, k)) for k in ("val_seqs", "val_full_max")})
    return Batches(train_t, val_t, ns, steps, device)


def seed_everything(seed, device):
    from megatron.core import tensor_parallel
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=device.type == "cpu")


def reference_weights(cfg, seed, device):
    """The initialization of `seed`: the weights of arm A's model built from it (every arm copies them)."""
    seed_everything(seed, device)
    model, _, _ = build_model(cfg, "A", device)
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    return w


class Probe:
    """What really ran: the FP8 rows on the wire (fp8a2a's Dispatcher output), what the experts got,
    whether TE's FP8 autocast (and which recipe) was on in the attention's first linear, and the
    routers' load: tokens per expert, summed on the device between evaluations (no sync)."""

    def __init__(self, model):
        self.dispatches = self.fp8_dispatches = 0
        self.experts_input, self.wire = set(), set()
        self.te_fp8 = None
        self.loads, self.load_trace = {}, []  # per layer [E] token counts; (step, max load / mean) per evaluation
        layers = list(model.decoder.layers)
        for i, layer in enumerate(layers):
            mlp = layer.mlp
            mlp.router.register_forward_hook(lambda m, args, out, i=i: self._count_load(i, m, out))
            inner = getattr(mlp.token_dispatcher, "dispatcher", None)
            if isinstance(inner, fp8a2a.Dispatcher):
                def dispatch(*args, _orig=inner.dispatch, **kw):
                    out = _orig(*args, **kw)
                    self.dispatches += 1
                    if isinstance(out.tokens, fp8a2a.QuantizedTensor):
                        self.fp8_dispatches += 1
                        self.wire.add(str(out.tokens.granularity))
                    return out
                inner.dispatch = dispatch
            mlp.experts.register_forward_pre_hook(lambda m, args: self.experts_input.add(type(args[0]).__name__))
        qkv = getattr(layers[0].self_attention, "linear_qkv", None)
        if qkv is not None and type(qkv).__module__.startswith("megatron.core.extensions"):
            qkv.register_forward_pre_hook(self._te_state)

    def _te_state(self, module, args):
        if self.te_fp8 is not None:
            return
        try:
            try:
                from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M
            except ImportError:
                from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as M
            on = bool(M.is_fp8_enabled())
            self.te_fp8 = dict(enabled=on, recipe=type(M.get_fp8_recipe()).__name__ if on else None)
        except Exception as e:  # noqa: BLE001  (a probe must not stop the run; the summary shows it)
            self.te_fp8 = dict(enabled=None, recipe=None, error=f"{type(e).__name__}: {e}")

    def _count_load(self, layer, router, out):
        if router.training:
            counts = out[1].sum(0, dtype=torch.float32)  # routing_map [tokens, experts]
            self.loads[layer] = counts + self.loads[layer] if layer in self.loads else counts

    def log_load(self, step):
        """The busiest expert's token count over the mean count, worst layer, since the last call."""
        if self.loads:
            worst = max(float(c.max() / c.mean().clamp_min(1e-9)) for c in self.loads.values())
            self.load_trace.append((step, round(worst, 4)))
            self.loads = {}

    def saved(self):  # what report() reads, for a run continued in another process (Arm.state)
        return dict(dispatches=self.dispatches, fp8_dispatches=self.fp8_dispatches, wire=sorted(self.wire),
                    experts_input=sorted(self.experts_input), te_fp8=self.te_fp8, load_trace=self.load_trace)

    def restore(self, st):
        self.dispatches, self.fp8_dispatches, self.te_fp8 = st["dispatches"], st["fp8_dispatches"], st["te_fp8"]
        self.wire, self.experts_input, self.load_trace = set(st["wire"]), set(st["experts_input"]), st["load_trace"]

    def report(self):
        return dict(fp8_wire=self.dispatches > 0 and self.fp8_dispatches == self.dispatches,
                    fp8_dispatch_fraction=(self.fp8_dispatches / self.dispatches) if self.dispatches else None,
                    wire_granularity=sorted(self.wire), experts_input=sorted(self.experts_input),
                    te_fp8=self.te_fp8, router_max_load=self.load_trace)


def decays(name, shape):
    """Whether AdamW decays this parameter: matrices, not embeddings (Megatron's rule)."""
    return len(shape) >= 2 and "embedding" not in name


def opt_order(names, shapes):
    """The parameters in the order Arm's AdamW holds them: the decayed group, then the rest."""
    return [n for n in names if decays(n, shapes[n])] + [n for n in names if not decays(n, shapes[n])]


class Arm:
    """One arm's model (the seed's initialization), FP32 master weights, AdamW, data order."""

    def __init__(self, arm, cfg, init, data, device, steps):
        self.arm, self.cfg, self.data, self.device, self.steps = arm, cfg, data, device, steps
        self.name = ARMS[arm][0]
        seed_everything(0, device)
        self.model, self.config, self.dispatcher = build_model(cfg, arm, device)
        params = dict(self.model.named_parameters())
        if set(params) != set(init):
            raise RuntimeError(f"arm {arm}: parameters differ from the reference: {sorted(set(params) ^ set(init))}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(init[n])
        self.init_checksum = float(sum(p.detach().double().sum() for p in params.values()))
        self.probe = Probe(self.model)
        self.params = list(params.values())
        fp32 = all(p.dtype == torch.float32 for p in self.params)
        self.master = self.params if fp32 else [p.detach().float().clone() for p in self.params]
        self.have = None  # indices of the parameters that got gradients
        self.names = list(params)
        master = dict(zip(self.names, self.master))
        decay = [master[n] for n in self.names if decays(n, params[n].shape)]
        other = [master[n] for n in self.names if not decays(n, params[n].shape)]
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=cfg.weight_decay),
                                      dict(params=other, weight_decay=0.0)], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                     foreach=True)
        s = cfg.seq
        self.pos = torch.arange(s, device=device)[None]
        # the local spec's attention takes the causal mask; TE's uses its causal mask type
        self.mask = None if cfg.te else torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]

    def loss(self, x, y):
        return self.model(x, self.pos.expand(x.shape[0], -1), self.mask, labels=y).float().mean()

    def state(self):
        """What a later process needs to continue this run: weights, masters, AdamW, RNG."""
        cuda = self.device.type == "cuda"
        return dict(model=self.model.state_dict(), opt=self.opt.state_dict(), rng=torch.get_rng_state(),
                    master=None if self.master is self.params else self.master, names=self.names,
                    cuda_rng=torch.cuda.get_rng_state(self.device) if cuda else None)

    def load_state(self, st):
        self.model.load_state_dict(st["model"])
        if st["master"] is not None:
            with torch.no_grad():
                for m, saved in zip(self.master, st["master"]):
                    m.copy_(saved)
        self.opt.load_state_dict(st["opt"])
        torch.set_rng_state(st["rng"])
        if st["cuda_rng"] is not None:
            torch.cuda.set_rng_state(st["cuda_rng"], self.device)
        invalidate_fp8_weight_cache()

    def load_weights(self, st, optimizer=True):
        """Another arm's state (st: its state()), to branch from it: the parameters by name and, with
        `optimizer`, the FP32 masters and AdamW's moments by name too. The models of two arms hold the
        same parameters, but their other state (TE's, the experts' modules) and order may differ."""
        src = st["names"]
        if set(src) != set(self.names):
            raise RuntimeError(f"{self.name}: parameters differ from the state's: {sorted(set(src) ^ set(self.names))}")
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(st["model"][n])
            if optimizer and self.master is not self.params:
                saved = dict(zip(src, st["master"]))
                for n, m in zip(self.names, self.master):
                    m.copy_(saved[n])
        if optimizer:
            shapes = {n: tuple(st["model"][n].shape) for n in src}
            at = {n: i for i, n in enumerate(opt_order(src, shapes))}
            o, groups, j = st["opt"], [], 0
            for g in o["param_groups"]:  # the same groups (one rule, the same names), renumbered
                groups.append(dict(g, params=list(range(j, j + len(g["params"])))))
                j += len(g["params"])
            state = {k: o["state"][at[n]] for k, n in enumerate(opt_order(self.names, shapes)) if at[n] in o["state"]}
            self.opt.load_state_dict(dict(state=state, param_groups=groups))
        invalidate_fp8_weight_cache()

    def new_weights(self):
        """Before the first micro-batch of a step or an evaluation, as Megatron's schedules do: TE
        casts its FP8 weights again (without it TE keeps the weights cast at step 1)."""
        if hasattr(self.model, "set_is_first_microbatch"):
            self.model.set_is_first_microbatch()

    def step(self, i):
        self.model.train()
        self.new_weights()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(i, self.steps, self.cfg)
        x, y = self.data.get(i)
        loss = self.loss(x, y)
        loss.backward()  # Megatron's routers add their aux-loss gradients (MoEAuxLossAutoScaler)
        if self.master is not self.params:  # BF16 grads -> the FP32 masters' (kept, overwritten each step)
            have = [i for i, p in enumerate(self.params) if p.grad is not None]
            if have != self.have:
                for i, m in enumerate(self.master):
                    m.grad = None
                for i in have:
                    self.master[i].grad = torch.empty_like(self.master[i])
                self.have = have
            torch._foreach_copy_([self.master[i].grad for i in have], [self.params[i].grad for i in have])
            for p in self.params:
                p.grad = None
        torch.nn.utils.clip_grad_norm_(self.master, self.cfg.grad_clip, foreach=True)
        self.opt.step()
        if self.master is self.params:
            self.opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        invalidate_fp8_weight_cache()  # the FP8 experts' cached weights (the copy above bumps versions too)
        return loss.detach()

    @torch.no_grad()
    def val_loss(self, full=False, batch=None):
        """Mean loss over the held-out windows (the fixed subset, or with `full` the whole split), in
        whole batches of `batch` windows (default: the training batch)."""
        self.model.eval()
        self.new_weights()
        v, tot, b = (self.data.val_full if full else self.data.val), 0.0, batch or self.cfg.batch
        for i in range(0, v.shape[0] - b + 1, b):  # whole batches (the training shape)
            w = v[i: i + b]
            tot = tot + self.loss(w[:, :-1], w[:, 1:]) * w.shape[0]
        self.model.train()
        return float(tot) / (v.shape[0] // b * b)


def calibrate(arms, cfg, init, data, device, steps, n=15):
    """Seconds per step, per logged evaluation and for the build + final evaluation, per arm (this
    also warms up kernels and autotuning)."""
    est = {}
    for arm in arms:
        t = time.perf_counter()
        r = Arm(arm, cfg, init, data[ARMS[arm][4]], device, steps)
        t_build = time.perf_counter() - t
        t_step = step_seconds(r, device, n)
        t = time.perf_counter()
        r.val_loss()
        t_val = time.perf_counter() - t
        t_full = t_val * data[1].val_full.shape[0] / max(1, data[1].val.shape[0])
        est[arm] = dict(step=t_step, val=t_val, fixed=t_build + t_full)
        del r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return est


def _checkpoint(path, cfg, steps, **fields):
    """Write atomically: a process killed while saving leaves the previous checkpoint."""
    tmp = path + ".tmp"
    torch.save(dict(config=vars(cfg), steps=steps, **fields), tmp)
    os.replace(tmp, path)


def _resume(path, cfg, steps, run):
    """The checkpoint of `run` at path, or None; it must come from the same configuration."""
    if not path or not os.path.exists(path):
        return None
    st = torch.load(path, map_location="cpu", weights_only=False)  # written by _checkpoint
    if st["steps"] != steps or st["config"] != vars(cfg):
        raise SystemExit(f"{run}: {path} comes from another configuration or step count; use another "
                         f"--checkpoint-dir (saved: {st['steps']} steps, {st['config']})")
    return st


def train(arm, cfg, init, data, device, steps, rows, run, deadline=None, log=print, ckpt_dir=None):
    path = os.path.join(ckpt_dir, f"{run}.pt") if ckpt_dir else None
    st = _resume(path, cfg, steps, run)
    if st is not None and "result" in st:  # finished in an earlier command
        log(f"{run}: finished earlier ({path})")
        rows += st["rows"]
        return st["result"]
    r = Arm(arm, cfg, init, data, device, steps)
    acc, n_acc, done, truncated, t_train = torch.zeros((), device=device), 0, 0, False, 0.0
    last, mine = None, []  # mine: this run's rows
    if st is not None:
        r.load_state(st["arm"])
        done, t_train, last, mine = st["done"], st["t_train"], st["last"], st["rows"]
        r.probe.restore(st["probe"])
        log(f"{run}: continuing from step {done} ({path})")
    sync(device)
    t = time.perf_counter()
    for i in range(done, steps):
        acc += r.step(i)
        n_acc += 1
        done = i + 1
        if done % cfg.log_every == 0 or done == steps:
            tl = float(acc) / n_acc
            t_train += time.perf_counter() - t
            t_val = time.perf_counter()
            vl = r.val_loss()
            t_val = time.perf_counter() - t_val
            if not (math.isfinite(tl) and math.isfinite(vl)):
                raise SystemExit(f"{run}: step {done}: loss {tl} / val {vl}")
            mine.append(dict(run=run, step=done, train_loss=tl, val_loss=vl))
            r.probe.log_load(done)
            last = (tl, vl)
            log(f"{run:28s} step {done:6d}  train {tl:.4f}  val {vl:.4f}  {1e3 * t_train / done:6.1f} ms/step")
            acc.zero_()
            n_acc = 0
            # stop unless one more interval and the final evaluation on the whole split still fit
            now = time.perf_counter()
            final_eval = t_val * data.val_full.shape[0] / max(1, data.val.shape[0])
            if deadline is not None and now + (now - t) + final_eval > deadline and done < steps:
                truncated = True
                log(f"{run}: the time budget ran out at step {done} of {steps}")
                break
            t = time.perf_counter()
    rows += mine
    if truncated and path:
        _checkpoint(path, cfg, steps, arm=r.state(), done=done, t_train=t_train, last=last, rows=mine,
                    probe=r.probe.saved())
        log(f"{run}: saved to {path}; the same command continues it")
    full = r.val_loss(full=True)
    out = dict(arm=arm, name=ARMS[arm][0], dispatcher=r.dispatcher, options=ARMS[arm][2],
               fp8_experts=ARMS[arm][3], data_order=ARMS[arm][4], steps=done, truncated=truncated,
               ms_per_step=round(1e3 * t_train / max(1, done), 2), final_train_loss=last[0] if last else None,
               final_val_loss_subset=last[1] if last else None, final_val_loss=full, init_checksum=r.init_checksum,
               experts=type(r.model.decoder.layers[0].mlp.experts).__name__, **r.probe.report())
    if path and not truncated:
        _checkpoint(path, cfg, steps, result=out, rows=mine)
    del r
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# main


def strip_args(argv, drop):
    """argv without the options in drop (and their values)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in drop:
            skip = True
            continue
        if x.split("=", 1)[0] in drop:
            continue
        out.append(x)
    return out


def run_jobs(a, arms, argv, log):
    """The arms in a.jobs processes at once (one GPU is far from busy with one such model), each
    writing DIR/job<k>; then DIR gets their rows and runs together."""
    groups = [arms[k::a.jobs] for k in range(a.jobs)]
    base = strip_args(argv, {"--jobs", "--out", "--arms", "--deadline-at"})
    if a.deadline_at:  # one deadline for all: each job's own clock starts after its imports
        base += ["--deadline-at", repr(a.deadline_at)]
    procs = []
    for k, g in enumerate(g for g in groups if g):
        d = os.path.join(a.out, f"job{k}")
        cmd = [sys.executable, os.path.abspath(__file__), *base, "--arms", ",".join(g), "--out", d, "--jobs", "1"]
        procs.append((d, subprocess.Popen(cmd)))
    bad = [d for d, p in procs if p.wait() != 0]
    if bad:
        raise SystemExit(f"jobs failed: {bad}")
    rows, runs, skipped, first = [], {}, [], None
    for d, _ in procs:
        with open(os.path.join(d, "summary.json")) as f:
            m = json.load(f)
        first = first or m
        runs.update(m["runs"])
        skipped += m.get("skipped") or []
        rows += read_csv(os.path.join(d, "convergence.csv"))
    meta = dict(first, runs=runs, skipped=skipped, jobs=a.jobs, job_dirs=[d for d, _ in procs])
    return rows, meta


def seed_summary(meta, log):
    runs = {r["arm"]: r for r in meta["runs"].values()}
    gaps = {ARMS[x][0]: gap(r, runs.get("A")) for x, r in runs.items() if x != "A"}
    meta["gaps_vs_bf16"] = gaps
    lines = [f"seed {meta['seed']}: final val loss (whole held-out split), {meta['steps']} steps",
             "| arm | run | val loss | vs A | ms/step | fp8_wire | experts input | TE FP8 |", "| --- |" + " --- |" * 7]
    for x, r in sorted(runs.items(), key=lambda kv: list(ARMS).index(kv[0])):
        te = r.get("te_fp8") or {}
        lines.append(f"| {x} | {r['name']} | {r['final_val_loss']:.5f} | {pct(gaps.get(r['name']))} | "
                     f"{r['ms_per_step']:.1f} | {r['fp8_wire']} | {','.join(r['experts_input'])} | "
                     f"{te.get('recipe') if te.get('enabled') else 'off'} |")
    if meta.get("skipped"):
        lines.append(f"skipped (time budget): {','.join(meta['skipped'])}: run them with --arms "
                     f"{','.join(meta['skipped'])} --seed {meta['seed']} --steps {meta['steps']} and merge")
    ms = sum(r["ms_per_step"] for r in runs.values()) / max(1, len(runs))
    steps = max(MIN_STEPS, meta["steps"])  # this run's length (the minimum for shorter smoke runs)
    lines.append(f"mean {ms:.1f} ms/step: {len(ARMS)} arms x {steps} steps ~ {len(ARMS) * steps * ms / 6e4:.1f} "
                 f"min of training, one process (an estimate from these runs, evaluations not counted)")
    text = "\n".join(lines)
    log(text)
    return text


def add_model_args(p):
    """The options model_config reads (sizes, spec, precision), the corpus and the threads: the same
    flags in every script that builds this model."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke)")
    p.add_argument("--local-spec", action="store_true", help="Megatron's local spec on the GPU too (no TE)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="BF16 weights (FP32 masters in AdamW) and activations (default: on for cuda, off for cpu)")
    p.add_argument("--fp8-recipe", default="blockwise", help="TE recipe on the GPU (Megatron's fp8_recipe; none: off)")
    for k in ("layers", "hidden", "heads", "experts", "topk", "moe-ffn", "shared-expert", "seq", "batch"):
        p.add_argument("--" + k, type=int, default=None)
    p.add_argument("--corpus-bytes", type=int, default=0, help="read at most this many corpus bytes (0: all)")
    p.add_argument("--threads", type=int, default=0)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seed", type=int, default=1, help="initialization and data order")
    p.add_argument("--steps", type=int, default=MIN_STEPS)
    p.add_argument("--out", default="out/seed1")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for this command (0: none): arms whose calibrated time does not fit are skipped")
    p.add_argument("--jobs", type=int, default=1, help="train the arms in this many processes at once")
    p.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)  # --jobs: the parent's, epoch s
    add_model_args(p)
    for k, t in (("lr", float), ("warmup", int), ("log-every", int), ("val-seqs", int), ("val-full-max", int)):
        p.add_argument("--" + k, type=t, default=None)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="train nothing: merge per-seed dirs into --out")
    p.add_argument("--at-step", type=int, help="--merge: the table also as of this step (logged subset), "
                   "where runs the deadline cut at or after it count")
    p.add_argument("--checkpoint-dir", help="save runs the deadline cuts here, and continue them from here")
    a = p.parse_args(argv)
    log = (lambda *s: None) if a.quiet else (lambda *s: print(*s, flush=True))
    if a.merge:
        return merge(a.merge, a.out, a.no_plot, log, a.at_step)

    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    arms = sorted(set(arms), key=list(ARMS).index)  # A first: every gap needs it
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny)")
    os.makedirs(a.out, exist_ok=True)
    if a.checkpoint_dir:  # absolute: the --jobs processes share it
        a.checkpoint_dir = os.path.abspath(a.checkpoint_dir)
        os.makedirs(a.checkpoint_dir, exist_ok=True)
    t_start = time.perf_counter()
    if a.time_budget > 0 and not a.deadline_at:
        a.deadline_at = time.time() + a.time_budget
    if a.jobs > 1 and len(arms) > 1:
        rows, meta = run_jobs(a, arms, argv, log)
    else:
        rows, meta = train_seed(a, arms, log)
    meta["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    text = seed_summary(meta, log)
    write_csv(rows, os.path.join(a.out, "convergence.csv"))
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(meta, f, indent=2)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    log(f"wrote {a.out}/convergence.csv, summary.json, summary.txt in {meta['total_wall_s']:.0f} s")
    return meta


def train_seed(a, arms, log):
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|moe_ffn_hidden_size).*")
    from megatron.core import __version__ as mcore_version
    from fp8a2a.megatron.standalone import world_of_one
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = model_config(a)
    fm.register()
    teardown = world_of_one(a.seed)
    train_t, val_t, corpus = load_corpus(a.corpus_bytes or None)
    data = {o: data_order(train_t, val_t, cfg, a.seed, o, max(a.steps, 16), device)
            for o in sorted({ARMS[x][4] for x in arms} | {1})}
    te = sys.modules.get("transformer_engine")
    versions = dict(torch=torch.__version__, megatron_core=mcore_version, fp8a2a=fp8a2a.__version__,
                    transformer_engine=getattr(te, "__version__", None) if te else None)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"{dev_name}; {versions}; corpus {corpus['train_bytes'] / 1e6:.1f} MB train / "
        f"{corpus['val_bytes'] / 1e6:.1f} MB val")
    log(f"GPTModel ({'TE' if cfg.te else 'local'} spec, FP8 recipe {cfg.fp8_recipe}): {cfg.layers} layers, d {cfg.hidden}, "
        f"{cfg.experts} experts top-{cfg.topk}, expert ffn {cfg.moe_ffn}, shared {cfg.shared_expert}, seq {cfg.seq} x "
        f"batch {cfg.batch}; seed {a.seed}; arms {','.join(arms)}; {a.steps} steps")
    init = reference_weights(cfg, a.seed, device)
    log(f"{sum(v.numel() for v in init.values()) / 1e6:.2f} M parameters")

    todo, skipped, calib = arms, [], None
    deadline = time.perf_counter() + (a.deadline_at - time.time()) if a.deadline_at else None
    # One arm (a --jobs process): nothing to choose, it trains until the deadline. A calibration while
    # the other processes start up overestimates (210 ms/step against 69 in training, seen on the H200).
    if deadline and len(arms) > 1:
        calib = calibrate(arms, cfg, init, data, device, a.steps)
        left = deadline - time.perf_counter()
        evals = a.steps // cfg.log_every + 1
        cost = {x: 1.05 * (c["step"] * a.steps + c["val"] * evals + c["fixed"]) for x, c in calib.items()}
        log("calibration: " + ", ".join(f"{x} {1e3 * c['step']:.1f} ms/step ({cost[x]:.0f} s)" for x, c in calib.items())
            + f"; {left:.0f} s left")
        todo, used = [], 0.0
        for x in arms:
            if used + cost[x] <= left:
                todo.append(x)
                used += cost[x]
            else:
                skipped.append(x)
        if skipped:
            log(f"NOTE: not enough time for arms {','.join(skipped)}: skipped (run them in another command)")
    rows, runs = [], {}
    for x in todo:
        run = run_name(x, a.seed)
        runs[run] = train(x, cfg, init, data[ARMS[x][4]], device, a.steps, rows, run, deadline, log,
                          ckpt_dir=a.checkpoint_dir)
    teardown()
    return rows, dict(seed=a.seed, steps=a.steps, device=dev_name, versions=versions, config=vars(cfg),
                      corpus=corpus, arms_requested=arms, skipped=skipped, runs=runs, time_budget_s=a.time_budget,
                      calibration={x: {k: round(v, 4) for k, v in c.items()} for x, c in calib.items()} if calib else None)


if __name__ == "__main__":
    main()
