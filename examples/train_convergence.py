#!/usr/bin/env python
"""Convergence of FP8 dispatch against BF16 dispatch on a real (small) MoE language-model run.

A byte-level MoE transformer (pre-norm, causal attention, an MoE FFN in every layer: router ->
softmax -> top-k -> fp8a2a.Dispatcher.dispatch -> experts -> Dispatcher.combine) is trained on the
Python standard library's own source files (read from this interpreter's installation; nothing is
downloaded). Every run starts from the same weights and sees the same batches in the same order;
only the dispatch (and, in one run, the expert GEMMs) differ:

  bf16            Dispatcher(bf16_below_bytes=huge): tokens travel unquantized; BF16 SwiGLU experts
  fp8_row         Dispatcher(bf16_below_bytes=0, granularity='row'): e4m3 rows + one scale per row
  fp8_block128    the same with one scale per 128 values
  fp8_row_fp8mlp  fp8_row, and the experts are fp8a2a.FP8GroupedMLP on the FP8 rows directly
  bf16_seed1      optional: bf16 with another init seed, the run-to-run noise floor

At world size 1 the dispatcher still packs, quantizes and unpacks (no collective is called), so
the numerics are those of a real expert-parallel run; bf16_below_bytes=0 forces the FP8 path.

Writes to --out: convergence.csv (run,step,train_loss,val_loss; train_loss is the mean over the
steps since the previous logged step, val_loss the loss on a fixed held-out set, both in nats per
byte), convergence.png and convergence_summary.json, and prints the final validation loss of each
run relative to bf16.

  python examples/train_convergence.py --out results                  # GPU, default config
  python examples/train_convergence.py --device cpu --tiny --steps 20  # CPU smoke
  python examples/train_convergence.py --merge DIR_SEED1 DIR_SEED2 --out results  # several seeds -> one result
"""
import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8a2a
from fp8a2a import Dispatcher, FP8GroupedMLP

RUNS = {  # name -> (granularity, bf16_below_bytes, fp8 expert GEMMs, init-seed offset)
    "bf16": ("row", 1 << 62, False, 0),
    "fp8_row": ("row", 0, False, 0),
    "fp8_block128": ("block128", 0, False, 0),
    "fp8_row_fp8mlp": ("row", 0, True, 0),
    "bf16_seed1": ("row", 1 << 62, False, 1),
}
DEFAULT_RUNS = "bf16,fp8_row,fp8_block128,fp8_row_fp8mlp,bf16_seed1"
TARGET_REL = 0.005  # final val loss within 0.5% of bf16


@dataclass
class Config:
    layers: int = 4
    d_model: int = 512
    heads: int = 8
    experts: int = 8
    topk: int = 2
    ffn: int = 1024
    seq: int = 256
    batch: int = 16
    vocab: int = 256
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_coef: float = 0.01
    val_seqs: int = 256  # windows of the held-out split evaluated at every logged step
    val_full_max: int = 4096  # windows of the final evaluation (the whole held-out split, up to this many)
    log_every: int = 50
    seed: int = 1234
    bf16_experts: str = "auto"  # BF16 expert GEMMs on CUDA: 'grouped_mm' (torch._grouped_mm), 'loop', 'auto'
    data_seed: int = 4321


FIELDS = ("layers", "d_model", "experts", "topk", "ffn", "seq", "batch", "lr", "log_every", "val_seqs", "seed",
          "bf16_experts")
TINY = dict(layers=2, d_model=128, heads=4, experts=4, topk=2, ffn=256, seq=64, batch=8, lr=3e-3, warmup=5,
            val_seqs=16, val_full_max=64, log_every=5)


# ---------------------------------------------------------------------------------------------
# data


def load_corpus(max_bytes=None, val_every=10):
    """(train uint8, val uint8, info): the standard library's .py files in sorted path order; every
    val_every-th file is held out for validation. Deterministic for a given Python installation."""
    root = os.path.dirname(os.__file__)
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    paths.sort(key=lambda p: os.path.relpath(p, root))
    train, val, size = [], [], 0
    for i, p in enumerate(paths):
        with open(p, "rb") as f:
            b = f.read()
        (val if i % val_every == val_every - 1 else train).append(b)
        size += len(b)
        if max_bytes and size >= max_bytes:
            break
    tr, va = b"".join(train), b"".join(val)
    info = dict(root=root, python=sys.version.split()[0], files=i + 1, train_bytes=len(tr), val_bytes=len(va))
    to_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return to_t(tr), to_t(va), info


class Batches:
    """The same batches in the same order for every run: offsets drawn once from a fixed seed."""

    def __init__(self, train, val, cfg, steps, device):
        g = torch.Generator().manual_seed(cfg.data_seed)
        n = train.numel() - cfg.seq - 1
        self.offsets = torch.randint(0, n, (steps, cfg.batch), generator=g)
        self.ar = torch.arange(cfg.seq + 1)
        self.train = train.to(device)
        self.device = device
        # fixed held-out set: val_seqs windows spread evenly over the validation split
        nv = val.numel() - cfg.seq - 1
        starts = torch.linspace(0, nv - 1, cfg.val_seqs).long()
        self.val = val[starts[:, None] + self.ar].long().to(device)
        # final evaluation: consecutive non-overlapping windows over the whole held-out split
        nf = min((val.numel() - 1) // cfg.seq, cfg.val_full_max)
        self.val_full = val[torch.arange(nf)[:, None] * cfg.seq + self.ar].long().to(device)

    def get(self, step):
        idx = (self.offsets[step][:, None] + self.ar).to(self.device, non_blocking=True)
        w = self.train[idx].long()
        return w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------------------------------------
# model


class MoE(nn.Module):
    def __init__(self, cfg, dispatcher, fp8_mlp, autocast_device):
        super().__init__()
        self.cfg, self.dispatcher, self.fp8_mlp, self.autocast_device = cfg, dispatcher, fp8_mlp, autocast_device
        self.grouped_mm = cfg.bf16_experts == "grouped_mm" or (cfg.bf16_experts == "auto" and hasattr(torch, "_grouped_mm"))
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        # One parameter set for every run (same init): FP8GroupedMLP's layout, fc1 [E, 2F, H] (gate
        # rows, then up rows), fc2 [E, H, F]. The BF16 runs compute the same SwiGLU on these weights.
        self.experts = FP8GroupedMLP(cfg.experts, cfg.d_model, cfg.ffn, activation="swiglu", dtype=torch.float32)

    def bf16_experts(self, x, tokens_per_expert, counts):
        """SwiGLU per expert on BF16 rows: one torch._grouped_mm per GEMM on CUDA (offsets from the
        device counts, no sync), else a loop over the experts' row blocks (host counts, no sync)."""
        w1, w2, f = self.experts.fc1_weight, self.experts.fc2_weight, self.cfg.ffn
        if x.is_cuda and self.grouped_mm:
            with torch.autocast("cuda", enabled=False):
                x = x.to(torch.bfloat16)
                offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
                z = torch._grouped_mm(x, w1.to(torch.bfloat16).transpose(-2, -1), offs=offs)
                return torch._grouped_mm(F.silu(z[:, :f]) * z[:, f:], w2.to(torch.bfloat16).transpose(-2, -1),
                                         offs=offs)
        outs = []
        for e, xe in enumerate(torch.split(x, counts)):
            z = xe @ w1[e].to(xe.dtype).t()
            outs.append((F.silu(z[:, :f]) * z[:, f:]) @ w2[e].to(xe.dtype).t())
        return torch.cat(outs)

    def forward(self, h):
        b, s, d = h.shape
        x = h.reshape(b * s, d).to(torch.bfloat16)  # what goes on the wire: BF16 activations
        with torch.autocast(self.autocast_device, enabled=False):
            probs = F.linear(x.float(), self.router.weight.float()).softmax(-1)
            topv, topi = probs.topk(self.cfg.topk, dim=-1)
            topv = topv / topv.sum(-1, keepdim=True)
            # Switch-style load balancing: E * sum_e (fraction of slots to e) * (mean prob of e)
            frac = F.one_hot(topi, self.cfg.experts).float().mean((0, 1))
            aux = self.cfg.experts * (frac * probs.mean(0)).sum()
            out = self.dispatcher.dispatch(x, topi, topv)
            self.fp8_wire = isinstance(out.tokens, fp8a2a.QuantizedTensor)  # reported per run
            if self.fp8_mlp:
                y = self.experts(out.tokens, out.tokens_per_expert)
            else:
                y = None
        if y is None:  # BF16 SwiGLU on the (dequantized) received rows (fp32 on CPU, where bf16 GEMMs are slow)
            dtype = torch.bfloat16 if torch.is_autocast_enabled(self.autocast_device) else torch.float32
            y = self.bf16_experts(out.dequantized(dtype), out.tokens_per_expert, out.handle.tokens_per_expert_list)
        y = self.dispatcher.combine(y, out.handle, apply_weights=True)
        return y.view(b, s, d), aux


class Block(nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.moe = moe

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoELM(nn.Module):
    def __init__(self, cfg, granularity, bf16_below_bytes, fp8_mlp, autocast_device):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList()
        for _ in range(cfg.layers):
            disp = Dispatcher(cfg.experts, granularity=granularity, bf16_below_bytes=bf16_below_bytes)
            self.blocks.append(Block(cfg, MoE(cfg, disp, fp8_mlp, autocast_device)))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        out_std = 0.02 / math.sqrt(2 * cfg.layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() < 2:
                    continue
                std = out_std if name.endswith(("proj.weight", "fc2_weight")) else 0.02
                p.normal_(0.0, std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        return self.head(self.ln_f(x)), aux / len(self.blocks)


# ---------------------------------------------------------------------------------------------
# training


def lr_at(step, steps, cfg):
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class Run:
    def __init__(self, name, cfg, device, batches, steps):
        granularity, below, fp8_mlp, seed_offset = RUNS[name]
        self.name, self.cfg, self.device, self.batches, self.steps = name, cfg, device, batches, steps
        self.amp = device.type == "cuda"
        torch.manual_seed(cfg.seed + seed_offset)
        self.model = MoELM(cfg, granularity, below, fp8_mlp, device.type).to(device)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2 and "tok" not in n and "pos" not in n]
        other = [p for n, p in self.model.named_parameters() if not (p.dim() >= 2 and "tok" not in n and "pos" not in n)]
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=cfg.weight_decay),
                                      dict(params=other, weight_decay=0.0)], lr=cfg.lr, betas=(0.9, 0.95),
                                     eps=1e-8, foreach=True)
        with torch.no_grad():
            self.init_checksum = float(sum(p.double().sum() for p in self.model.parameters()))

    def loss(self, x, y):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            logits, aux = self.model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)), aux

    def step(self, i):
        for g in self.opt.param_groups:
            g["lr"] = lr_at(i, self.steps, self.cfg)
        x, y = self.batches.get(i)
        loss, aux = self.loss(x, y)
        (loss + self.cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()  # any optimizer, fused too: the FP8 weight cache also keys on optimizer steps
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def val_loss(self, full=False, chunk=64):
        self.model.eval()
        v, tot = (self.batches.val_full if full else self.batches.val), 0.0
        for i in range(0, v.shape[0], chunk):
            w = v[i: i + chunk]
            tot = tot + self.loss(w[:, :-1], w[:, 1:])[0] * w.shape[0]
        self.model.train()
        return float(tot) / v.shape[0]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(run, device, n):
    """Seconds per run.step(i) over steps 5..n-1, after steps 0..4 (warm-up: kernels, autotuning)."""
    for i in range(5):
        run.step(i)
    sync(device)
    t = time.perf_counter()
    for i in range(5, n):
        run.step(i)
    sync(device)
    return (time.perf_counter() - t) / (n - 5)


def calibrate(names, cfg, device, batches, steps, n=30):
    """Seconds per training step and per evaluation of each run (also warms up kernels/autotuning)."""
    est, n = {}, max(6, min(n, steps))
    for name in names:
        r = Run(name, cfg, device, batches, steps)
        t_step = step_seconds(r, device, n)
        t = time.perf_counter()
        r.val_loss()
        est[name] = (t_step, time.perf_counter() - t)
        del r
    return est


def train(name, cfg, device, batches, steps, rows, deadline=None, quiet=False):
    r = Run(name, cfg, device, batches, steps)
    acc, n_acc, done, truncated = torch.zeros((), device=device), 0, 0, False
    t0 = time.perf_counter()
    last = None
    for i in range(steps):
        acc += r.step(i)
        n_acc += 1
        done = i + 1
        if done % cfg.log_every == 0 or done == steps:
            tl, vl = float(acc) / n_acc, r.val_loss()
            acc.zero_()
            n_acc = 0
            rows.append(dict(run=name, step=done, train_loss=tl, val_loss=vl))
            last = (tl, vl)
            if not math.isfinite(tl) or not math.isfinite(vl):
                print(f"[{name}] non-finite loss at step {done}: train {tl} val {vl}", flush=True)
                truncated = True
                break
            if not quiet and (done % 250 == 0 or done == steps):
                ms = 1e3 * (time.perf_counter() - t0) / done
                print(f"[{name:>15}] step {done:5d}/{steps}  train {tl:.4f}  val {vl:.4f}  {ms:6.1f} ms/step "
                      f"(incl. eval)", flush=True)
            if deadline is not None and time.perf_counter() > deadline and done < steps:
                print(f"[{name}] time budget exhausted at step {done}; stopping this run", flush=True)
                truncated = True
                break
    sync(device)
    wall = time.perf_counter() - t0
    full = r.val_loss(full=True)
    if not quiet:
        print(f"[{name:>15}] final loss on the whole held-out split ({r.batches.val_full.shape[0]} x {cfg.seq} bytes): "
              f"{full:.4f}", flush=True)
    return dict(steps=done, truncated=truncated, wall_s=round(wall, 2), ms_per_step=round(1e3 * wall / max(done, 1), 2),
                final_train_loss=last[0] if last else None, final_val_loss=last[1] if last else None,
                final_val_loss_full=full, init_checksum=r.init_checksum,
                fp8_wire=all(b.moe.fp8_wire for b in r.model.blocks))


def summarize(rows, stats, names):
    """Final losses of each run relative to bf16. The headline (val_loss, rel_to_bf16) is the loss on
    the whole held-out split after the last step, when every run reached the same step; otherwise the
    logged subset's val loss at the last step all runs reached."""
    by = {n: {r["step"]: r for r in rows if r["run"] == n} for n in names}
    common = set.intersection(*(set(v) for v in by.values())) if by else set()
    step = max(common) if common else None
    full = len({stats[n]["steps"] for n in names}) == 1 and step == stats[names[0]]["steps"]
    rel = lambda v, ref: (v / ref - 1.0) if (v is not None and ref) else None  # noqa: E731
    ref_row = by.get("bf16", {}).get(step) if step is not None else None
    ref_full = stats["bf16"]["final_val_loss_full"] if "bf16" in stats else None
    out = {}
    for n in names:
        row = by[n].get(step) if step is not None else None
        v_sub, t = (row["val_loss"], row["train_loss"]) if row else (None, None)
        r_sub = rel(v_sub, ref_row["val_loss"] if ref_row else None)
        r_full = rel(stats[n]["final_val_loss_full"], ref_full) if full else None
        head_v = stats[n]["final_val_loss_full"] if full else v_sub
        head_r = r_full if full else r_sub
        out[n] = dict(stats[n], compared_at_step=step, headline="whole held-out split" if full else "logged val subset",
                      val_loss=head_v, rel_to_bf16=head_r,
                      within_target=(abs(head_r) <= TARGET_REL) if head_r is not None else None,
                      val_loss_subset=v_sub, rel_to_bf16_subset=r_sub,
                      train_loss=t, rel_to_bf16_train=rel(t, ref_row["train_loss"] if ref_row else None),
                      min_val_loss_subset=min((r["val_loss"] for r in by[n].values()), default=None))
    return step, out


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["run", "step", "train_loss", "val_loss"])
        w.writeheader()
        for r in rows:
            w.writerow(dict(run=r["run"], step=r["step"], train_loss=f"{r['train_loss']:.5f}",
                            val_loss=f"{r['val_loss']:.5f}"))


def read_csv(path):
    with open(path) as f:
        return [dict(run=r["run"], step=int(r["step"]), train_loss=float(r["train_loss"]),
                     val_loss=float(r["val_loss"])) for r in csv.DictReader(f)]


def plot(rows, names, path, groups=None):
    """Loss curves (val solid, train faint), the val curves zoomed on the last quarter of the steps, and
    each run's val loss relative to its reference. groups: run -> (variant, seed label or None, reference
    run); one colour per variant, one line style per seed. Default: every run its own variant vs bf16."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = groups or {n: (n, None, "bf16") for n in names}
    variants = list(dict.fromkeys(g[0] for g in groups.values()))
    seeds = list(dict.fromkeys(g[1] for g in groups.values()))
    styles = ["-", "--", ":", "-."]
    by = {n: [r for r in rows if r["run"] == n] for n in names}
    last = max((r["step"] for r in rows), default=0)
    fig, (a, z, b) = plt.subplots(1, 3, figsize=(17, 4.8))
    zoom = []
    for n in names:
        variant, seed, ref_run = groups[n]
        kw = dict(color=f"C{variants.index(variant) % 10}", ls=styles[seeds.index(seed) % len(styles)])
        rr, label = by[n], variant if seed is None else f"{variant}, seed {seed}"
        s, v = [r["step"] for r in rr], [r["val_loss"] for r in rr]
        a.plot(s, v, label=label, **kw)
        a.plot(s, [r["train_loss"] for r in rr], alpha=0.3, lw=0.8, **kw)
        zs = [(x, y) for x, y in zip(s, v) if x >= 0.75 * last]
        z.plot([p[0] for p in zs], [p[1] for p in zs], marker=".", ms=3, label=label, **kw)
        zoom += [p[1] for p in zs]
        ref = {r["step"]: r["val_loss"] for r in by.get(ref_run, [])}
        if ref and n != ref_run:
            pts = [(r["step"], 100 * (r["val_loss"] / ref[r["step"]] - 1)) for r in rr if r["step"] in ref]
            b.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **kw)
    a.set_xlabel("step"), a.set_ylabel("loss (nats/byte)"), a.set_title("validation (solid) and train (faint) loss")
    a.set_ylim(top=min(a.get_ylim()[1], 3.0))
    a.legend(fontsize=7), a.grid(alpha=0.3)
    if zoom:
        pad = 0.05 * (max(zoom) - min(zoom)) + 1e-4
        z.set_ylim(min(zoom) - pad, max(zoom) + pad)
    z.set_xlabel("step"), z.set_ylabel("val loss (nats/byte)"), z.set_title("validation loss, last quarter")
    z.legend(fontsize=7), z.grid(alpha=0.3)
    b.axhspan(-100 * TARGET_REL, 100 * TARGET_REL, color="green", alpha=0.1, label="±0.5% target")
    b.axhline(0, color="k", lw=0.8)
    b.set_xlabel("step"), b.set_ylabel("val loss vs bf16 (%)")
    b.set_title("relative to BF16 dispatch" + (" of the same seed" if len(seeds) > 1 else ""))
    b.set_ylim(-3, 3)
    b.legend(fontsize=7), b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(dirs, out, no_plot=False):
    """One result set from several per-seed runs of this script (each dir: convergence.csv and
    convergence_summary.json). Runs of the first dir keep their names, the others get _seed<config.seed>.
    Every run is compared with the bf16 run of its own seed (summarize); per variant, the mean of those
    relative final val losses over the seeds; the bf16 seed-to-seed spread is the noise level."""
    rows, per_seed, groups, variants = [], {}, {}, {}
    for k, d in enumerate(dirs):
        meta = json.load(open(os.path.join(d, "convergence_summary.json")))
        seed, seed_rows = meta["config"]["seed"], read_csv(os.path.join(d, "convergence.csv"))
        if str(seed) in per_seed:
            raise ValueError(f"{d}: seed {seed} appears twice")
        names = list(dict.fromkeys(r["run"] for r in seed_rows))
        step, summary = summarize(seed_rows, meta["runs"], names)
        suffix = "" if k == 0 else f"_seed{seed}"
        rows += [dict(r, run=r["run"] + suffix) for r in seed_rows]
        groups.update({n + suffix: (n, seed, "bf16" + suffix) for n in names})
        for n in names:
            variants.setdefault(n, {})[str(seed)] = summary[n]
        per_seed[str(seed)] = dict(dir=d, run_suffix=suffix, compared_at_step=step, steps=meta.get("steps"),
                                   device=meta.get("device"), torch=meta.get("torch"), config=meta["config"],
                                   runs=summary)
    mean = lambda xs: sum(xs) / len(xs) if xs and None not in xs else None  # noqa: E731
    table = {}
    for n, by_seed in variants.items():
        rel = {s: v["rel_to_bf16"] for s, v in by_seed.items()}
        m = mean(list(rel.values()))
        table[n] = dict(val_loss={s: v["val_loss"] for s, v in by_seed.items()}, rel_to_bf16=rel,
                        mean_rel_to_bf16=m, within_target_mean=(abs(m) <= TARGET_REL) if m is not None else None)
    ref = table["bf16"]["val_loss"]
    first = next(iter(ref.values()))
    spread = dict(val_loss=ref, rel_to_first_seed={s: v / first - 1.0 for s, v in ref.items()},
                  max_over_min=max(ref.values()) / min(ref.values()) - 1.0)
    merged = dict(merged_from=list(dirs), seeds=[int(s) for s in per_seed], target_rel=TARGET_REL,
                  headline="final val loss on the whole held-out split, vs the bf16 run of the same seed",
                  variants=table, bf16_seed_spread=spread, per_seed=per_seed)
    os.makedirs(out, exist_ok=True)
    write_csv(rows, os.path.join(out, "convergence.csv"))
    with open(os.path.join(out, "convergence_summary.json"), "w") as f:
        json.dump(merged, f, indent=2)
    if not no_plot:
        try:
            plot(rows, list(groups), os.path.join(out, "convergence.png"), groups)
        except ImportError:
            print("matplotlib missing: no plot")
    pct = lambda r: "n/a" if r is None else f"{100 * r:+.2f}%"  # noqa: E731
    seeds = list(per_seed)
    print("final val loss vs bf16 of the same seed (whole held-out split)")
    print("| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | mean within 0.5% |")
    print("| --- |" + " --- |" * (len(seeds) + 2))
    for n, t in table.items():
        print(f"| {n} | " + " | ".join(pct(t["rel_to_bf16"].get(s)) for s in seeds)
              + f" | {pct(t['mean_rel_to_bf16'])} | {t['within_target_mean']} |")
    print(f"bf16 seed-to-seed spread (max/min - 1): {pct(spread['max_over_min'])}")
    print(f"wrote {out}/convergence.csv, convergence_summary.json" + ("" if no_plot else ", convergence.png"))
    return merged


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--out", default="results")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for all runs together (0: none). With a budget, each run is timed for a few "
                        "steps first and --steps is lowered (to a multiple of the log interval) if needed")
    p.add_argument("--tiny", action="store_true", help="a tiny model for CPU smoke runs")
    p.add_argument("--corpus-bytes", type=int, default=0, help="read at most this many corpus bytes (0: all)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="train nothing: merge the per-seed outputs in these dirs (first dir's runs keep their names, "
                        "the others get _seed<N>) into --out")
    for f in FIELDS:
        p.add_argument("--" + f.replace("_", "-"), type=type(getattr(Config, f)), default=None)
    a = p.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out, a.no_plot)

    cfg = Config(**(TINY if a.tiny else {}))
    for f in FIELDS:
        if getattr(a, f) is not None:
            setattr(cfg, f, getattr(a, f))
    names = [n.strip() for n in a.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(a.out, exist_ok=True)
    log = (lambda *s: None) if a.quiet else (lambda *s: print(*s, flush=True))

    t_start = time.perf_counter()
    train_t, val_t, corpus = load_corpus(a.corpus_bytes or None)
    steps = a.steps
    batches = Batches(train_t, val_t, cfg, steps, device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"fp8a2a {fp8a2a.__version__}, torch {torch.__version__}, {dev_name}; corpus: {corpus['files']} stdlib files, "
        f"{corpus['train_bytes'] / 1e6:.1f} MB train / {corpus['val_bytes'] / 1e6:.1f} MB val (Python {corpus['python']})")
    log(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.experts} experts top-{cfg.topk}, ffn {cfg.ffn}, "
        f"seq {cfg.seq} x batch {cfg.batch}; runs: {', '.join(names)}; {steps} steps")

    note = None
    calib = None
    if a.time_budget > 0:
        calib = calibrate(names, cfg, device, batches, steps)
        left = a.time_budget - (time.perf_counter() - t_start)
        per_step = sum(ts + te / cfg.log_every for ts, te in calib.values())
        fit = int(0.92 * left / per_step) // cfg.log_every * cfg.log_every
        log("calibration: " + ", ".join(f"{n} {1e3 * ts:.1f} ms/step" for n, (ts, _) in calib.items())
            + f"; {left:.0f} s left fits {fit} steps per run")
        if fit < steps:
            steps = max(cfg.log_every, fit)
            note = f"--time-budget {a.time_budget:g}s: steps lowered from {a.steps} to {steps}"
            log("NOTE: " + note)
    deadline = t_start + a.time_budget if a.time_budget > 0 else None

    rows, stats = [], {}
    for n in names:
        stats[n] = train(n, cfg, device, batches, steps, rows, deadline, a.quiet)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step, summary = summarize(rows, stats, names)

    write_csv(rows, os.path.join(a.out, "convergence.csv"))
    meta = dict(config=asdict(cfg), steps_requested=a.steps, steps=steps, note=note, device=dev_name,
                torch=torch.__version__, fp8a2a=fp8a2a.__version__, corpus=corpus, target_rel=TARGET_REL,
                compared_at_step=step, total_wall_s=round(time.perf_counter() - t_start, 1),
                calibration_ms_per_step={n: round(1e3 * v[0], 2) for n, v in calib.items()} if calib else None,
                same_init=len({round(s["init_checksum"], 6) for n, s in stats.items() if RUNS[n][3] == 0}) <= 1,
                runs=summary)
    with open(os.path.join(a.out, "convergence_summary.json"), "w") as f:
        json.dump(meta, f, indent=2)
    if not a.no_plot:
        try:
            plot(rows, names, os.path.join(a.out, "convergence.png"))
        except ImportError:
            log("matplotlib missing: no plot")

    pct = lambda r: "n/a" if r is None else f"{100 * r:+.2f}%"  # noqa: E731
    num = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    head = summary[names[0]]["headline"] if names else ""
    print(f"\nfinal losses at step {step} (nats/byte); val = {head}; target: within {100 * TARGET_REL:.1f}% of bf16")
    print("| run | val loss | vs bf16 | val subset vs bf16 | train loss (last interval) | vs bf16 | ms/step | within 0.5% |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        s = summary[n]
        ok = "n/a" if s["within_target"] is None else ("yes" if s["within_target"] else "NO")
        print(f"| {n} | {num(s['val_loss'])} | {pct(s['rel_to_bf16'])} | {pct(s['rel_to_bf16_subset'])} | "
              f"{num(s['train_loss'])} | {pct(s['rel_to_bf16_train'])} | {s['ms_per_step']:.1f} | {ok} |")
    if note:
        print("NOTE: " + note)
    print(f"wrote {a.out}/convergence.csv, convergence_summary.json" + ("" if a.no_plot else ", convergence.png")
          + f" in {time.perf_counter() - t_start:.0f} s")
    return meta


if __name__ == "__main__":
    main()
