"""One GPU as one rank of an EP=n group (fp8a2a.loopback): what FP8 buys at your EP size, over a
link that binds, before renting a cluster. `python -m fp8a2a.bench --emulate-ep N --link pcie`
calls emulate(); benchmarks/bench_loopback.py runs the published matrix with Megatron's own
dispatcher added.

Per case (a model's per-rank load at EP=n: tokens per rank, hidden, experts, top-k; uniform random
routing) and per link, each variant is one training step of the exchange, timed as device time per
call (fp8a2a.bench.costs.TIMING), median of each run, median [min-max] over the runs:

  dispatch_fwd/fp8   fp8a2a dispatch forward, FP8 wire (bf16_below_bytes=0)
  dispatch_fwd/bf16  the same with fp8a2a's BF16 wire (bf16_below_bytes huge: rows unquantized)
  dispatch/fp8       dispatch forward + backward (the backward: the row gradients back, BF16 default)
  dispatch/bf16      the same, BF16 wire
  step/fp8           dispatch + combine, forward + backward, default precisions
  step/fp8_all       the same with fp8_combine and fp8_dispatch_backward: all four exchanges FP8
  step/bf16          the same on the BF16 wire
  step/megatron_style  fp8a2a.bench.baseline's plain-torch copy of Megatron's alltoall dispatcher
                       (unfused, one row per token and expert, tokens and probs exchanged)
The expert is a stand-in that costs nothing: its output is a fixed tensor of the received rows'
shape, its backward hands the output gradient to the rows unchanged (Megatron-side stand-ins
multiply by the received probs, as Megatron's experts do; fp8a2a applies router weights in combine).

Printed with every result: the bytes each exchange puts on the link (metered in the loopback
group), the link's bandwidth measured alone at those message sizes, and the additive model's
prediction: the variant's time over link `none` + the link's measured time for each message (the
scale model's form, fp8a2a.bench.model: kernels + bytes / bandwidth, no overlap)."""
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import loopback
from ..dispatcher import Dispatcher
from ..quant import QuantizedTensor
from .baseline import MegatronStyleAlltoAll, make_routing
from .costs import TIMING, spread, time_calls

MODELS = {"deepseek-v3": dict(hidden=7168, experts=256, topk=8),
          "qwen3-235b": dict(hidden=4096, experts=128, topk=8),
          "mixtral-8x7b": dict(hidden=4096, experts=8, topk=2)}
BF16_WIRE = 1 << 62  # bf16_below_bytes that keeps every dispatch unquantized


@dataclass(frozen=True)
class Case:
    model: str
    ep: int
    tokens: int
    hidden: int
    experts: int
    topk: int

    @classmethod
    def of(cls, model: str, ep: int, tokens: int = 4096) -> "Case":
        return cls(model, ep, tokens, **MODELS[model])

    @property
    def name(self) -> str:
        return f"{self.model}@EP{self.ep}"


@dataclass
class Inputs:
    """One case's tensors on the device: activations and router weights that require grad (a training
    forward), Megatron's routing map and probs, and the output gradient."""
    case: Case
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    rmap: torch.Tensor
    probs: torch.Tensor
    gy: torch.Tensor

    @classmethod
    def make(cls, case: Case, device, seed: int = 0) -> "Inputs":
        idx, w, rmap, probs = make_routing(case.tokens, case.experts, case.topk, device, seed)
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        x = torch.randn(case.tokens, case.hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
        gy = torch.randn(case.tokens, case.hidden, generator=g).to(device, torch.bfloat16)
        return cls(case, x, idx, w.requires_grad_(), rmap, probs.requires_grad_(), gy)


class _StandIn(torch.autograd.Function):
    """The expert stand-in: forward returns `out` (a fixed tensor of the rows' shape, no kernel),
    backward hands the output gradient to `rows` unchanged."""

    @staticmethod
    def forward(ctx, rows, out):
        ctx.dtype = rows.dtype
        return out.view(out.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def fixed_like(rows: torch.Tensor, cache: dict) -> torch.Tensor:
    """A fixed random bf16 tensor of rows' shape (one per shape, kept in cache)."""
    key = tuple(rows.shape)
    if key not in cache:
        cache[key] = torch.randn(key, device=rows.device).to(torch.bfloat16)
    return cache[key]


def expert_stand_in(rows: torch.Tensor, cache: dict) -> torch.Tensor:
    """The stand-in expert's output for rows: fixed_like(rows), autograd-connected to rows."""
    return _StandIn.apply(rows, fixed_like(rows, cache))


@dataclass
class Variant:
    """name, label, the precision of the four exchanges (dispatch, combine, combine backward,
    dispatch backward: None where the variant has no such exchange), and build(inputs) -> step()."""
    name: str
    label: str
    precision: Dict[str, Optional[str]]
    build: Callable[[Inputs], Callable[[], object]]


def precision(dispatch, combine=None, combine_bwd=None, dispatch_bwd=None):
    """A variant's precision per exchange (None: the variant has no such exchange)."""
    return dict(dispatch=dispatch, combine=combine, combine_backward=combine_bwd, dispatch_backward=dispatch_bwd)


def fp8a2a_variant(name, label, *, combine: bool, backward: bool, **opts) -> Variant:
    """fp8a2a dispatch (forward only unless backward) or dispatch + combine (always forward +
    backward), with Dispatcher options opts."""
    if combine and not backward:
        raise ValueError("fp8a2a_variant: dispatch + combine is measured as a training step (backward=True)")
    raw = opts.get("bf16_below_bytes", 0) >= BF16_WIRE
    wire = "bf16" if raw else "fp8 " + opts.get("granularity", "row")
    prec = precision(wire,
                      ("fp8 row" if opts.get("fp8_combine") else "bf16") if combine else None,
                      ("bf16" if raw else "fp8 row") if combine and backward else None,
                      ("fp8 row" if opts.get("fp8_dispatch_backward") else "bf16") if backward else None)

    def build(inp: Inputs):
        c = inp.case
        d = Dispatcher(c.experts, **opts)
        outs = {}
        x, w = (inp.x, inp.w) if backward else (inp.x.detach(), inp.w.detach())

        def step():
            out = d.dispatch(x, inp.idx, w)
            rows = out.tokens.grad_anchor if isinstance(out.tokens, QuantizedTensor) else out.tokens
            if not combine:
                if backward:  # the experts' input gradient back to the tokens
                    x.grad = w.grad = None
                    torch.autograd.backward([rows], [fixed_like(rows, outs)])
                return out
            y = d.combine(expert_stand_in(rows, outs), out.handle)
            x.grad = w.grad = None
            y.backward(inp.gy)
            return y
        return step
    return Variant(name, label, prec, build)


def megatron_style_variant() -> Variant:
    def build(inp: Inputs):
        m = MegatronStyleAlltoAll(inp.case.experts)
        outs = {}

        def step():
            rows, _, p = m.dispatch(inp.x, inp.rmap, inp.probs)
            y = m.combine(expert_stand_in(rows, outs) * p.unsqueeze(1).to(rows.dtype))
            inp.x.grad = inp.probs.grad = None
            y.backward(inp.gy)
            return y
        return step
    return Variant("step/megatron_style", "plain-torch copy of Megatron's alltoall dispatcher (unfused), BF16",
                   precision("bf16", "bf16", "bf16", "bf16"), build)


def default_variants(megatron_style: bool = True) -> List[Variant]:
    v = [fp8a2a_variant("dispatch_fwd/fp8", "fp8a2a dispatch, FP8 wire", combine=False, backward=False,
                        bf16_below_bytes=0),
         fp8a2a_variant("dispatch_fwd/bf16", "fp8a2a dispatch, BF16 wire", combine=False, backward=False,
                        bf16_below_bytes=BF16_WIRE),
         fp8a2a_variant("dispatch/fp8", "fp8a2a dispatch fwd+bwd, FP8 wire", combine=False, backward=True,
                        bf16_below_bytes=0),
         fp8a2a_variant("dispatch/bf16", "fp8a2a dispatch fwd+bwd, BF16 wire", combine=False, backward=True,
                        bf16_below_bytes=BF16_WIRE),
         fp8a2a_variant("step/fp8", "fp8a2a dispatch+combine fwd+bwd, defaults", combine=True, backward=True,
                        bf16_below_bytes=0),
         fp8a2a_variant("step/fp8_all", "fp8a2a dispatch+combine fwd+bwd, all four exchanges FP8", combine=True,
                        backward=True, bf16_below_bytes=0, fp8_combine=True, fp8_dispatch_backward=True),
         fp8a2a_variant("step/bf16", "fp8a2a dispatch+combine fwd+bwd, BF16 wire", combine=True, backward=True,
                        bf16_below_bytes=BF16_WIRE)]
    return v + ([megatron_style_variant()] if megatron_style else [])


# Ratios per run (numerator, denominator); a step's baseline is the first of BASELINES present.
BASELINES = ("step/megatron_fused", "step/megatron_unfused", "step/megatron_style", "step/bf16")
RATIOS = [("dispatch_fwd/fp8", "dispatch_fwd/bf16"), ("dispatch/fp8", "dispatch/bf16"),
          ("step/fp8", "baseline"), ("step/fp8_all", "baseline"), ("step/fp8", "step/bf16")]


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


class LinkTimes:
    """loopback.measure_link per (link, size bucket), cached: a message's link time at its own size
    (buckets within 1/8 above the size; above 1 MiB the bucket's time scales to the size)."""

    def __init__(self, device):
        self.device, self.cache = device, {}

    @staticmethod
    def bucket(nbytes: int) -> int:
        if nbytes <= 64 << 10:
            return 64 << 10
        step = 1 << max(16, nbytes.bit_length() - 4)  # within 1/8 above
        return -(-nbytes // step) * step

    def ms(self, link: str, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        b = self.bucket(nbytes)
        if (link, b) not in self.cache:
            self.cache[(link, b)] = loopback.measure_link(link, b, self.device)
        m = self.cache[(link, b)]
        return m["ms"] * (nbytes / b if b > (1 << 20) else 1.0)

    def table(self):
        return [dict(m) for m in self.cache.values()]


def run_case(case: Case, links: Sequence[str], variants: Sequence[Variant], *, repeat: int = 3, iters: int = 8,
             warmup: int = 2, device=None, link_times: Optional[LinkTimes] = None, log=None) -> dict:
    """One case in the running loopback world (its size must be case.ep): every variant over every
    link, `repeat` runs with the variants' order rotating, per run the median of `iters` calls."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    w = loopback.world()
    if w is None or w.size != case.ep:
        raise RuntimeError(f"run_case: needs a loopback world of {case.ep} ranks (loopback.init), got "
                           f"{None if w is None else w.size}")
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    link_times = link_times or LinkTimes(device)
    w.num_experts = case.experts  # Megatron's counts all-gather: relabelled
    inp = Inputs.make(case, device, seed=w.rank)
    res = {"case": asdict(case), "variants": {}}
    steps = {}
    for v in variants:
        rec = res["variants"][v.name] = {"label": v.label, "precision": v.precision, "device_ms": {}}
        try:
            log(f"loopback bench: {case.name} building {v.name}")
            fn = v.build(inp)
            loopback.set_link("pcie")  # one metered call: the bytes of each exchange (any link but none)
            fn()
            with loopback.metered() as calls:
                fn()
            if cuda:
                torch.cuda.synchronize()
            rec["messages"] = [b for name, b in calls if name != "self"]
            rec["link_bytes"] = sum(rec["messages"])
            rec["self_bytes"] = sum(b for name, b in calls if name == "self")
            steps[v.name] = fn
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is a row, not a crash
            rec["unavailable"] = _reason(e)
            log(f"loopback bench: {case.name} {v.name} unavailable: {rec['unavailable']}")
    runs = {(name, link): [] for name in steps for link in links}
    for r in range(repeat):
        for link in links:
            loopback.set_link(link)
            live = [n for n in steps if steps[n] is not None]
            shift = r % max(1, len(live))
            for name in live[shift:] + live[:shift]:
                try:
                    dev, _ = time_calls(steps[name], iters, warmup, cuda)
                except Exception as e:  # noqa: BLE001
                    res["variants"][name]["unavailable"] = f"failed in run {r + 1} over {link}: {_reason(e)}"
                    steps[name] = None
                    continue
                runs[(name, link)].append(statistics.median(dev))
    for name in steps:
        rec = res["variants"][name]
        for link in links:
            rec["device_ms"][link] = spread(runs[(name, link)])
        if not cuda or "messages" not in rec:
            continue
        rec["link_ms"], rec["link_gbps"], rec["predicted_ms"] = {}, {}, {}
        none_ms = rec["device_ms"].get("none", {}).get("median")
        for link in links:
            if link == "none":
                continue
            t = sum(link_times.ms(link, b) for b in rec["messages"])
            rec["link_ms"][link] = t
            rec["link_gbps"][link] = rec["link_bytes"] / t / 1e6 if t else None
            rec["predicted_ms"][link] = none_ms + t if none_ms is not None else None
    res["baseline"] = next((b for b in BASELINES if b in steps and len(runs.get((b, links[0]), [])) == repeat), None)
    res["ratios"] = {}
    for link in links:
        out = {}
        for num, den in RATIOS:
            den = res["baseline"] if den == "baseline" else den
            a, b = runs.get((num, link), []), runs.get((den, link), [])
            if den and len(a) == len(b) == repeat:
                out[f"{num} / {den}"] = spread([x / y for x, y in zip(a, b)])
        res["ratios"][link] = out
    del inp, steps
    return res


# ---- output ------------------------------------------------------------------------------------

def _span(s, fmt="{:.2f}"):
    if not s or s.get("median") is None:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def format_case(res: dict, links: Sequence[str]) -> str:
    c = res["case"]
    lines = [f"== {c['model']} at EP={c['ep']}: {c['tokens']} tokens/rank x {c['hidden']}, {c['experts']} experts "
             f"({c['experts'] // c['ep']} local), top-{c['topk']}"]
    head = f"{'variant':<22}{'MB/step':>9}" + "".join(f"{link + ' ms':>24}" for link in links)
    remote = [lk for lk in links if lk != "none"]
    head += "".join(f"{'model ' + lk + ' ms':>17}{lk + ' GB/s':>12}" for lk in remote)
    head += "  precision (disp/comb/comb-bwd/disp-bwd)"
    lines.append(head)
    for name, v in res["variants"].items():
        if "unavailable" in v and not v.get("device_ms", {}).get(links[0], {}).get("runs"):
            lines.append(f"{name:<22}unavailable: {v['unavailable']}")
            continue
        mb = "-" if "link_bytes" not in v else f"{v['link_bytes'] / 1e6:.1f}"
        row = f"{name:<22}{mb:>9}" + "".join(f"{_span(v['device_ms'].get(lk)):>24}" for lk in links)
        for lk in remote:
            p = (v.get("predicted_ms") or {}).get(lk)
            g = (v.get("link_gbps") or {}).get(lk)
            row += f"{'-' if p is None else f'{p:.2f}':>17}{'-' if g is None else f'{g:.1f}':>12}"
        prec = "/".join(str(v["precision"][k] or "-") for k in ("dispatch", "combine", "combine_backward",
                                                                "dispatch_backward"))
        lines.append(row + "  " + prec)
    for lk in links:
        rs = "; ".join(f"{k} {_span(s, '{:.3f}')}" for k, s in res["ratios"].get(lk, {}).items())
        lines.append(f"ratios over {lk} (per run): {rs or '-'}")
    return "\n".join(lines)


def format_links(link_rows: List[dict]) -> str:
    if not link_rows:
        return "link bandwidth: not measured (no CUDA)"
    by = {}
    for m in sorted(link_rows, key=lambda m: (m["link"], m["bytes"])):
        by.setdefault(m["link"], []).append(f"{m['bytes'] / 2**20:.1f} MiB {m['gbps_each_way']:.1f}")
    return "\n".join(f"link {k} measured alone, GB/s each way at the sweep's message sizes: " + ", ".join(v)
                     for k, v in by.items())


# ---- the CLI's entry point ---------------------------------------------------------------------

def emulate(ep: int, link: str = "pcie", *, models: Optional[Sequence[str]] = None, tokens: int = 4096,
            repeat: int = 3, iters: int = 8, warmup: int = 2, variants: Optional[Sequence[Variant]] = None,
            json_path: Optional[str] = None, out=print) -> dict:
    """`python -m fp8a2a.bench --emulate-ep N --link L`: this process as rank 0 of a loopback EP=ep
    world (made here, torn down after) on the current device; every model of MODELS whose experts
    divide over ep ranks (or `models`), over `link` and over `none` (the kernels alone: the model's
    base). Prints one table per case and returns (and writes to json_path) the document."""
    links = ["none"] if link == "none" else ["none", link]
    models = list(models or MODELS)
    cases = [Case.of(m, ep, tokens) for m in models if MODELS[m]["experts"] % ep == 0]
    if not cases:
        raise ValueError(f"--emulate-ep {ep}: no model of {models} has a multiple of {ep} experts")
    owner = loopback.world() is None
    if owner:
        loopback.init(ep, rank=0, link=link)
    cuda = torch.cuda.is_available()
    lt = LinkTimes(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    doc = {"benchmark": "fp8a2a loopback EP emulation (fp8a2a.bench.loopback)",
           "label": f"one GPU, loopback EP={ep} over {link}" + (" (emulated InfiniBand rail)" * (link == "pcie")),
           "device": torch.cuda.get_device_name() if cuda else "CPU (functional only)", "torch": torch.__version__,
           "timing": TIMING, "repeat": repeat, "iters": iters, "warmup": warmup, "links": links, "cases": []}
    t0 = time.time()
    try:
        for c in cases:
            res = run_case(c, links, variants or default_variants(), repeat=repeat, iters=iters, warmup=warmup,
                           link_times=lt)
            doc["cases"].append(res)
            out(format_case(res, links))
    finally:
        if owner:
            loopback.destroy()
    doc["link_measurements"] = lt.table()
    doc["seconds"] = time.time() - t0
    out(format_links(doc["link_measurements"]))
    if json_path:
        import json
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc
