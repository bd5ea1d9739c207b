"""What a compiled plan model checks at every call: dynamo's guards on what its hooks read while traced.

``torch.compile`` of a parallelized model traces the plan's hooks, and every Python object they read becomes a
guard that torch evaluates before each compiled call (most in C++; an identity check between two paths to one
object is a Python lambda). On an H200 the guards were most of what the compiled plan Wan costs over the
hand-written one (CHANGELOG.md, older measurements, sixth round). Two reads cost hundreds of guards and are left
out while tracing (``plan/runtime.py``, ``plan/args.py``):

- ``dispatch.install``, which compares diffusers' attention registry with what it left there: a guard on every
  backend and every constraint check (~390 on the tiny Wan);
- finding the hooked modules' parameter places (``Args``): dynamo cannot read the ``WeakKeyDictionary`` cache and
  traced ``inspect.signature`` at every hook (~210 guards); ``parallelize`` finds them once (``known_places``).

Counted, not timed: one process, rank 0 of a fake world of 2 (``dsp_plugin.fake_world``), ``torch._dynamo.explain``.
"""

from __future__ import annotations

import copy

import torch


def test_compiled_wan_guards_read_neither_the_attention_registry_nor_inspect() -> None:
    import torch._dynamo as dynamo

    import dsp_plugin
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.fake_world import fake_world

    dynamo.reset()
    with fake_world(2, dsp=2), torch.no_grad():
        reference, batch = _setup((2, 2, 8, 2, 4))
        model = dsp_plugin.parallelize(copy.deepcopy(reference))
        explained = dynamo.explain(model)(*batch, return_dict=False)
    texts = [" ".join(g.code_list or [g.name]) for g in explained.out_guards]
    print(f"compiled tiny Wan: {explained.graph_count} graph(s), {explained.graph_break_count} break(s), "
          f"{len(texts)} guards")
    # no break: the model's own pre-hook is a frame of its own (torch runs a compiled model's hooks outside dynamo),
    # whose graph holds the entry check's op (plan/compiled_entry.py); the forward is the other graph
    assert not explained.break_reasons and explained.graph_count == 2, explained.break_reasons
    registry = [t for t in texts if "plan_dot_dispatch" in t]
    print(f"  on plan.dispatch's state: {len(registry)}: {registry}")
    # what the wrapper reads at a call (whether diffusers' checks are on), not the backends and their checks
    assert not [t for t in registry if "_installed" in t or "_backends" in t or "_constraints" in t], registry
    assert len(registry) < 10, registry
    assert not [t for t in texts if "__import_inspect" in t or ".inspect." in t], texts
