"""What each host-path choice of fp8a2a's FP8 experts is worth in a Megatron MoELayer step: the
current path against the same layer with one choice (or all) swapped for the alternative it
replaced, in one process, interleaved (bench_megatron_layer.py's timing loop and rows), with
TE FP8 blockwise as the scale. A diagnostic of the host path after the dispatch's count sync (the
GPU waits on the host there), not a table row: bench_megatron_layer.py's table is the figure.

    python benchmarks/ablate_layer_host_path.py [--shapes 0,1] [--repeat 3]   (--cpu: tiny shapes,
    functional only, no TE row)

Alternatives, each a function patched in for that row's calls only:
  functional_call   the experts run FP8GroupedMLP through torch.func.functional_call (a
                    parameter swap per call), not FP8GroupedMLP.forward_with
  device counts     the dispatcher hands the FP8 experts the counts on the device: they sum them
                    there (cumsum) and check them with a device assert, not on the host (this row
                    also builds the host counts' tensor before dropping it: a few us more than the
                    path it stands for)
  getattr params    the expert parameters (two per expert) read through nn.Module attribute
                    lookups, not the module and parameter dicts
  six-op routing    Megatron's routing map turned into top-k with six torch ops, not one kernel
                    (ops.routing_map_to_topk)
  ten-op routing    the same with ten ops
  all               every alternative at once (the ten-op routing for the routing): the host
                    path before these choices (but for the cached device-capability query and
                    fc2's weight looked up after fc1's launch)
"""
import argparse
import contextlib
import statistics

import torch

import bench_megatron_layer as bm  # this script's own directory is on sys.path
import fp8a2a.megatron as fm
from fp8a2a.bench import costs
from fp8a2a.megatron import dispatcher as md, experts as me
from fp8a2a.quant import QuantizedTensor
from fp8a2a.reference import routing_map_to_topk_reference

ROW = "fp8_alltoall + fp8_experts_spec fp8_dgrad"  # the default under a TE FP8 recipe
BASELINE = bm.BASELINE


def _functional_call_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *a, **kw):
    x = permuted_local_hidden_states
    if not isinstance(x, QuantizedTensor) and x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    self._run_weight_pre_hooks()
    w1, w2 = self._fp8_weights()
    return torch.func.functional_call(self._fp8a2a_impl, {"fc1_weight": w1, "fc2_weight": w2},
                                      (x, tokens_per_expert, permuted_probs.reshape(-1))), None


def _getattr_params(self):
    if hasattr(self, "local_experts"):
        return [e.linear_fc1.weight for e in self.local_experts], [e.linear_fc2.weight for e in self.local_experts]
    n = self.num_local_experts
    return ([getattr(self.linear_fc1, f"weight{i}") for i in range(n)],
            [getattr(self.linear_fc2, f"weight{i}") for i in range(n)])


def _ten_op_routing(routing_map, probs, topk, drop_zero=False):
    if drop_zero:
        routing_map = routing_map & (probs != 0)
    e = routing_map.shape[1]
    k = max(1, min(int(topk), e))
    key = routing_map.to(torch.int32) * torch.arange(e, 0, -1, device=routing_map.device, dtype=torch.int32)
    val, idx = torch.topk(key, k, dim=1, sorted=True)
    valid = val > 0
    weights = torch.where(valid, probs.gather(1, idx), torch.zeros((), dtype=probs.dtype, device=probs.device))
    return torch.where(valid, idx, torch.full_like(idx, -1)), weights


_CURRENT_POSTPROCESS = md.FP8AlltoAllTokenDispatcher.dispatch_postprocess


def _device_counts_postprocess(self, hidden_states, probs):
    out = self._out
    tokens, _, probs = _CURRENT_POSTPROCESS(self, hidden_states, probs)
    return tokens, out.tokens_per_expert, probs


ALTERNATIVES = {
    "functional_call": {(me._FP8ExpertsMixin, "forward"): _functional_call_forward},
    "device counts": {(md.FP8AlltoAllTokenDispatcher, "dispatch_postprocess"): _device_counts_postprocess},
    "getattr params": {(cls, "_expert_params"): _getattr_params for cls in me.fp8_expert_classes().values()},
    "six-op routing": {(md, "routing_map_to_topk"): routing_map_to_topk_reference},
    "ten-op routing": {(md, "routing_map_to_topk"): _ten_op_routing},
}
ALTERNATIVES["all"] = {k: v for alt in list(ALTERNATIVES.values()) for k, v in alt.items()}


@contextlib.contextmanager
def patched(items):
    saved = {key: getattr(*key) for key in items}
    for (owner, name), fn in items.items():
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def run_shape(shape, cuda):
    T, E, K, H = shape[:4]
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, 1, H, generator=g).to(dev, torch.bfloat16)
    gy = (torch.randn(T, 1, H, generator=g) * 0.01).to(dev, torch.bfloat16)
    variants, router = [], None
    for name in (BASELINE, ROW) if cuda else (ROW,):
        layer, cfg = bm.make_layer(shape, *bm.VARIANTS[name], cuda)
        router = layer.router.weight.detach().clone() if router is None else router
        with torch.no_grad():
            layer.router.weight.copy_(router)  # one routing for both layers
        variants.append(bm.layer_variant(name, layer, cfg, x, gy))
    current = variants.pop()

    def with_alternative(items):
        def step():
            with patched(items):
                current.step()
        return step

    return variants + [bm.Variant("current", current.step, current.prepare)] + [
        bm.Variant(alt, with_alternative(items), current.prepare) for alt, items in ALTERNATIVES.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0,1", help="indices into bench_megatron_layer's shapes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (functional only)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    fm.register()
    teardown = bm.world_of_one()
    shapes = list((bm.GPU_SHAPES if cuda else bm.CPU_SHAPES).items())
    out = {}
    try:
        for i in args.shapes.split(","):
            name, shape = shapes[int(i)]
            vs = run_shape(shape, cuda)
            runs = [bm.time_group(vs, args.iters, 3 if cuda else 1, cuda, burst=0)[0] for _ in range(args.repeat)]
            print(f"\n## {name}: {ROW}, fwd+bwd ms, median [min-max] of {args.repeat} runs; against "
                  f"'current' per run (> 1: the alternative is slower){'; TE FP8 blockwise for scale' if cuda else ''}")
            out[name] = rows = {}
            for v in vs:
                meds = [statistics.median(r[v.name]) for r in runs]
                ratio = [statistics.median(r[v.name]) / statistics.median(r["current"]) for r in runs]
                rows[v.name] = {"ms": meds, "vs_current": ratio}
                line = (f"{v.name:28s} {statistics.median(meds):7.3f} [{min(meds):.3f}-{max(meds):.3f}]  "
                        f"x{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]")
                c = costs.profile_call(lambda _: v.step(), setup=v.prepare)
                if c is not None:  # CUDA: one profiled step
                    line += (f"  busy {c['busy_us'] / 1e3:.2f} span {c['span_us'] / 1e3:.2f}  longest gaps: " + "; ".join(
                        f"{gp['us']:.0f} us {gp['before'][:24]} -> {gp['after'][:24]}" for gp in c["gaps"][:2]))
                print(line, flush=True)
            del vs
            if cuda:
                torch.cuda.empty_cache()
    finally:
        teardown()
    return out


if __name__ == "__main__":
    main()
