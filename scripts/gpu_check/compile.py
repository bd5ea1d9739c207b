"""torch.compile with Inductor on CUDA (issue 28): plan-parallelized models compiled as users compile them.

The suite's compile checks (``tests/test_compile_models.py``) run ``backend="aot_eager"`` on the CPU: the
captured graph with eager kernels. Here the same models and inputs (``dsp_plugin.testing.tiny.compile_case``:
the reference STDiT, the tiny Wan, the tiny Latte) run on ``cuda:0`` through ``torch.compile``'s default
backend, Inductor (Triton kernels generated and run), two gloo ranks sharing the GPU (NCCL refuses two ranks
on one device; gloo moves CUDA tensors through the host). Per case, rank 0's figures:

- graphs, break reasons (any frame in dsp_plugin fails the case), recompiles on the second compiled step;
- host syncs per compiled step: ``aten._local_scalar_dense`` through a dispatch mode (the suite's count);
- max |compiled - eager| of the output, the input's gradient and the parameters' gradients, fp32, on the GPU
  (FP8 wire: against the eager FP8 model, beside |FP8 - bf16 wire| so the payload is seen in use);
- eager and compiled step time (forward + backward, median of the timed steps, ``cuda.synchronize`` around).
  The tiny models are launch-bound and the collectives go through gloo's host copies: the times say what
  compiling saves of the Python and the launches, not a cluster's step.

    python scripts/gpu_check/compile.py                      # every case
    python scripts/gpu_check/compile.py --cases wan wan-fp8   # some
    python scripts/gpu_check/compile.py --device cpu --cases stdit   # the CPU form (Inductor's C++ codegen)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402

#: name -> (model of compile_case, or "wan-bench": the bench's Wan; comm_dtype; dynamic)
CASES: dict[str, tuple[str, Any, bool]] = {   # in the order they run: most telling first
    "wan": ("wan", None, False),
    "stdit": ("stdit", None, False),
    "latte": ("latte", None, False),
    "wan-fp8": ("wan", "fp8", False),
    "wan-bench": ("wan-bench", None, False),
    "stdit-fp8": ("stdit", "fp8", False),
    "wan-dynamic": ("wan", None, True),
}
TIMED = 10
TOLERANCE = 1e-4   # fp32, Inductor's fused kernels against eager's (TF32 off, torch's default)


def _case(name: str, device: torch.device) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    if name == "wan-bench":
        from dsp_plugin.bench.wan import SIZE, _setup

        model, args = _setup(SIZE)
        kwargs: dict[str, Any] = {"return_dict": False}
    else:
        from dsp_plugin.testing.tiny import compile_case

        model, args, kwargs = compile_case(name)
    return model.to(device), tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), kwargs


def _timed(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> float:
    from tests.test_compile_models import _step

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for _ in range(TIMED):
        sync()
        start = time.perf_counter()
        _step(model, args, kwargs)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _one(rank: int, n: int, case: str, device: torch.device, no_plan: bool = False) -> dict[str, Any]:
    """One case on this rank; with one rank the plan's switches move nothing and no collective is traced.
    ``no_plan``: the model as its authors wrote it, no plan (what torch does to it alone)."""
    import torch._dynamo as dynamo
    from torch._dynamo.backends.debugging import ExplainWithBackend

    import dsp_plugin
    from tests.test_compile_models import COLLECTIVE, HostSyncs, _nodes, _reads_value, _reason, _step

    name, comm_dtype, dynamic = CASES[case]
    base, args, kwargs = _case(name, device)

    def made() -> torch.nn.Module:
        return copy.deepcopy(base) if no_plan else dsp_plugin.parallelize(copy.deepcopy(base), comm_dtype=comm_dtype)

    eager_model = made()
    eager = _step(eager_model, args, kwargs)
    plain = _step(dsp_plugin.parallelize(copy.deepcopy(base)), args, kwargs) if comm_dtype and not no_plan else None
    dynamo.reset()
    model = made()
    _step(model, args, kwargs)   # the first call's cross-rank checks run eagerly (a compiled call skips them)
    explain = ExplainWithBackend("inductor")
    compiled = torch.compile(model, backend=explain, dynamic=dynamic)
    start = time.perf_counter()
    _step(compiled, args, kwargs)
    compile_s = time.perf_counter() - start
    traced = len(explain.graphs)
    with HostSyncs() as syncs:
        out, dx, grads = _step(compiled, args, kwargs)
    explained = explain.output()
    graphs = [g for g in explained.graphs if len(g.graph.nodes)]
    e_out, e_dx, e_grads = eager
    rel = {name: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()   # per parameter, by name
           for (name, _), a, b in zip(model.named_parameters(), grads, e_grads) if a is not None}
    result = {
        "case": case + (" (no plan)" if no_plan else ""), "device": str(device), "dynamic": dynamic,
        "comm_dtype": comm_dtype,
        "graphs": len(graphs), "reasons": [_reason(b) for b in explained.break_reasons],
        "recompiled": len(explain.graphs) - traced, "host_syncs": syncs.count, "sync_sites": dict(syncs.sites),
        "grads_rel": max(rel.values()), "worst_grad": max(rel, key=rel.get),
        "traced_syncs": sum(_reads_value(n, set()) for g in graphs for n in _nodes(g)),
        "collective_graphs": sum(any(any(c in str(n.target) for c in COLLECTIVE) for n in _nodes(g)) for g in graphs),
        "out": (out - e_out).abs().max().item(), "dx": (dx - e_dx).abs().max().item(),
        "grads": max((a - b).abs().max().item() for a, b in zip(grads, e_grads) if a is not None),
        "fp8_vs_plain": None if plain is None else (e_out - plain[0]).abs().max().item(),
        "compile_s": compile_s,
    }
    result["ours"] = [r for r in result["reasons"] if r["ours"]]
    result["eager_ms"] = _timed(eager_model, args, kwargs, device)
    result["compiled_ms"] = _timed(compiled, args, kwargs, device)
    limit = TOLERANCE if plain is None else max(TOLERANCE, result["fp8_vs_plain"])
    result["ok"] = (not result["ours"] and result["host_syncs"] == 0 and result["recompiled"] == 0
                    and (result["collective_graphs"] >= 1 or n == 1)
                    and max(result["out"], result["dx"], result["grads"]) <= limit)
    print(f"[compile] rank {rank} {json.dumps(result)}", flush=True)
    return result


def worker(rank: int, n: int, device_name: str, cases: list[str], no_plan: bool = False) -> list[dict[str, Any]]:
    from dsp_plugin.log import quiet_third_party
    from dsp_plugin.topology import Topology, set_topology

    quiet_third_party()
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_topology(Topology.world())
    results = []
    for case in cases:
        try:
            results.append(_one(rank, n, case, device, no_plan))
        except Exception as exc:  # noqa: BLE001 - one case's failure is its FAIL line, the others still run
            import traceback

            traceback.print_exc()
            results.append({"case": case, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return results


def probe(rank: int, n: int, device_name: str, compiled: bool) -> str:
    """torch's functional all-to-all on this device, no dsp_plugin: what the compiled graphs call; eager, or
    inside ``torch.compile`` (Inductor) between two pointwise ops, forward and backward."""
    from torch.distributed import _functional_collectives as funcol

    def fn(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_to_all_single_autograd(x * 2, [2] * n, [2] * n, torch.distributed.group.WORLD) + 1

    x = (torch.arange(4.0, device=device_name) + 4 * rank).requires_grad_(True)
    got = (torch.compile(fn) if compiled else fn)(x)
    got.sum().backward()
    return f"{got.detach().cpu().tolist()} grad {x.grad.cpu().tolist()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default; SKIP without CUDA) or cpu")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", default=None, help="also write rank 0's results here")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="gloo (default; 2 ranks may share a GPU) or nccl (one rank per GPU: --nproc 1 here)")
    parser.add_argument("--no-plan", action="store_true",
                        help="compile the models without a plan: what torch and the model do alone (the baseline)")
    parser.add_argument("--compiled", action="store_true", help="with --probe: the all-to-all inside torch.compile")
    parser.add_argument("--probe", action="store_true",
                        help="only torch's functional all-to-all of 2 floats per rank on this device and backend")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        skip("no CUDA device")
    from dsp_plugin.spawn import spawn

    start = time.perf_counter()
    if args.probe:
        got = spawn(probe, args.nproc, args.device, args.compiled, timeout=120, backend=args.backend)
        finish(True, f"{'compiled ' * args.compiled}funcol.all_to_all_single on {args.device} over {args.backend}, "
                     f"{args.nproc} ranks: {got}")
    # a compile may take minutes before a rank's first collective
    results = spawn(worker, args.nproc, args.device, args.cases, args.no_plan, timeout=1200, collective_timeout_s=600,
                    backend=args.backend)
    print(f"\n| case | graphs | breaks in dsp_plugin | host syncs | recompiled | max diff out/dx/grads "
          f"| FP8 vs bf16 wire | compile s | eager ms | compiled ms |\n|{' --- |' * 10}")
    for r in results[0]:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error']} |")
            continue
        fp8 = "" if r["fp8_vs_plain"] is None else f"{r['fp8_vs_plain']:.1e}"
        print(f"| {r['case']} | {r['graphs']} | {len(r['ours'])} | {r['host_syncs']} | {r['recompiled']} "
              f"| {r['out']:.1e} / {r['dx']:.1e} / {r['grads']:.1e} (rel {r['grads_rel']:.0e} {r['worst_grad']}) "
              f"| {fp8} | {r['compile_s']:.1f} "
              f"| {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} |")
    for r in results[0]:
        if r.get("sync_sites"):
            print(f"host reads of {r['case']}, by site: {r['sync_sites']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    bad = [r["case"] for rank_results in results for r in rank_results if not r["ok"]]
    finish(not bad, f"{len(args.cases) - len(set(bad))}/{len(args.cases)} cases compiled with Inductor on "
                    f"{args.device} equal eager, no break in dsp_plugin, no host sync "
                    f"({args.nproc} {args.backend} ranks, "
                    f"{time.perf_counter() - start:.0f} s){'; failed: ' + ' '.join(sorted(set(bad))) if bad else ''}")


if __name__ == "__main__":
    main()
