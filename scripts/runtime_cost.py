"""The plan runtime's own Python per forward of the bench's Wan, measured from outside it, without timing noise.

    PYTHONPATH=. python scripts/runtime_cost.py [label] [--size L,H,D,F,HW] [--rounds N]

One process, as rank 0 of a fake world of 2 (torch's ``fake`` process group: the same Python path as a real
rank, collectives that move no data); one forward under ``no_grad`` (a denoising step). Two figures:

- *calls*: the Python calls (functions and builtins) made inside the runtime's hooks and its dispatch wrapper
  in one forward, the collectives and the attention kernel left out (``sys.setprofile``). Deterministic;
- *replay*: the forward's plan hook and dispatch calls recorded once, then replayed alone, in order, many
  times, with the collectives and the kernel stubbed (they return the recorded outputs): median and minimum
  microseconds per forward. It runs warm (a hook in a real forward starts cold, after a kernel), so it
  is a lower bound of what the runtime costs in a forward, steady from run to run where the A/B against
  the hand-written Wan (``python -m dsp_plugin.bench.overhead --against-hand``) is not. One exception: the
  recorded arguments keep every tensor the forward tagged alive, so ``proj_out``'s lookup of its untagged
  output by alias keys ~14 tags per replay (~37 us warm), where a real forward has 0-5 of them alive then.

To compare two trees, run it with PYTHONPATH at each, alternating, in the same session (docs/benchmarks.md,
"The plan runtime's share, fourth round").
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from typing import Any

import torch

import dsp_plugin
from dsp_plugin.bench.wan import SIZE, _setup
from dsp_plugin.dryrun.world import fake_world
from dsp_plugin.head_switch import exchange
from dsp_plugin.plan import dispatch, ops
from dsp_plugin.plan.wrap import wrappers

# the work the runtime hands on, which the hand-written model does too: left out of the counts, stubbed in replay
_COLLECTIVES = (("exchange.py", "_to_heads"), ("exchange.py", "from_heads"), ("primitives.py", "gather"))


def _hooked(model: Any, before: dict[int, set[int]], wrap: Any) -> None:
    """Wrap every hook ``parallelize`` registered (those the model has now and had not before, and those around
    its modules' forwards: ``plan/wrap.py``)."""
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in set(hooks) - before.get(id(hooks), set()):
                hooks[key] = wrap(hooks[key])
    for wrapper in wrappers(model):
        for side in ("pre", "post", "bypass"):
            if getattr(wrapper, side) is not None:
                setattr(wrapper, side, wrap(getattr(wrapper, side)))


def measure(size: tuple[int, ...], rounds: int) -> dict[str, float]:
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    recording = [False]

    def recorder(fn: Any) -> Any:
        def entry(*args: Any, **kwargs: Any) -> Any:  # the name the call count starts at
            if recording[0]:
                calls.append((fn, args, kwargs))
            return fn(*args, **kwargs)
        entry._dsp_heads_original = getattr(fn, "_dsp_heads_original", None)  # still one of dispatch's wrappers
        return entry

    torch.set_num_threads(1)
    with fake_world(2, dsp=2), torch.no_grad():
        reference, batch = _setup(size)
        model = copy.deepcopy(reference)
        before = {id(h): set(h) for m in model.modules() for h in (m._forward_pre_hooks, m._forward_hooks)}
        dsp_plugin.parallelize(model)
        _hooked(model, before, recorder)
        registry = dispatch._registry()
        for name, fn in list(registry._backends.items()):
            registry._backends[name] = recorder(fn)
        for _ in range(2):  # warm-up: the first calls check inputs and learn how each module attends
            model(*batch, return_dict=False)

        # calls: every Python and builtin call below a recorded entry, not below a collective or the kernel
        count: list[int] = [0]
        stack: list[bool] = []  # per frame: is it inside the runtime (below an entry, not below a collective)

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                code = frame.f_code
                name = (code.co_filename.rsplit("/", 1)[-1], code.co_name)
                inside = bool(stack) and stack[-1]
                if inside and (name in _COLLECTIVES or name[1] == "_native_attention"):
                    stack.append(False)
                    return
                if not stack or not inside:
                    stack.append(name == ("runtime_cost.py", "entry"))
                    return
                count[0] += 1
                stack.append(True)
            elif event == "return":
                if stack:
                    stack.pop()
            elif event == "c_call" and stack and stack[-1]:
                count[0] += 1

        sys.setprofile(profile)
        model(*batch, return_dict=False)
        sys.setprofile(None)

        # replay: record one forward's calls and the collectives' outputs, then replay the calls alone
        outputs: dict[str, list[Any]] = {"to": [], "from": [], "gather": []}
        real = (exchange._to_heads, exchange.from_heads, ops.gather)

        def keep(key: str, fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                outputs[key].append(out)
                return out
            return call

        position: dict[str, int] = {}

        def stub(key: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                i = position.get(key, 0)
                position[key] = i + 1
                return outputs[key][i % len(outputs[key])]
            return call

        exchange._to_heads, exchange.from_heads, ops.gather = keep("to", real[0]), keep("from", real[1]), \
            keep("gather", real[2])
        try:
            recording[0] = True
            model(*batch, return_dict=False)
            recording[0] = False
            exchange._to_heads, exchange.from_heads, ops.gather = stub("to"), stub("from"), stub("gather")
            kernel = dispatch._wrap_backend("native", lambda **kwargs: kwargs["query"])  # the kernel: identity
            steps = [(kernel if "query" in kwargs else fn, args, kwargs) for fn, args, kwargs in calls]
            times = []
            gc.disable()
            for _ in range(rounds):
                position.clear()
                start = time.perf_counter_ns()
                for fn, args, kwargs in steps:
                    fn(*args, **kwargs)
                times.append(time.perf_counter_ns() - start)
        finally:
            gc.enable()
            exchange._to_heads, exchange.from_heads, ops.gather = real
    return {"calls": count[0], "entries": len(calls), "replay_us": statistics.median(times) / 1e3,
            "replay_min_us": min(times) / 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/runtime_cost.py", description=__doc__.split("\n")[0])
    parser.add_argument("label", nargs="?", default="this tree")
    parser.add_argument("--size", default=",".join(map(str, SIZE)), metavar="L,H,D,F,HW",
                        help="the Wan: layers, heads, head dim, latent frames, latent height = width (default: "
                             "the bench's)")
    parser.add_argument("--rounds", type=int, default=3000, help="replays of the forward's calls (default 3000)")
    args = parser.parse_args(argv)
    size = tuple(int(v) for v in args.size.split(","))
    r = measure(size, args.rounds)
    print(f"{args.label}: Wan {size}: {r['calls']} Python calls in the runtime per forward; its {r['entries']} "
          f"hook and dispatch calls replayed alone: median {r['replay_us']:.1f} us, min {r['replay_min_us']:.1f} "
          f"us per forward ({args.rounds} replays)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
