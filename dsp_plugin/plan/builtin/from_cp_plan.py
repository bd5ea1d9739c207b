"""A plan derived from a diffusers model's own context-parallel plan (``_cp_plan``), for a model with no built-in one.

diffusers declares where its context parallelism splits and gathers (``ContextParallelInput`` on a module's inputs
or outputs, ``ContextParallelOutput`` on its outputs) and runs every attention whose processor passes its parallel
config through Ulysses or ring attention. The derived plan keeps the splits and gathers and puts the head switch
where diffusers uses Ulysses, in its own terms:

==========================================  ===========================================================
``_cp_plan``                                derived
==========================================  ===========================================================
``{"hidden_states": Input(split_dim=d)}``   ``Split("hidden_states", layout, shard="L")``, the layout's dim
                                            ``d`` the sequence ``L`` (``expected_dims`` dims)
``{0: Input(..., split_output=True)}``      ``Split("out", ...)``: every tensor of the output (RoPE's
                                            ``(cos, sin)``)
``Output(gather_dim=d)``                    ``Gather("out", ...)``
an input named ``encoder_*``                left whole on every rank: the text is not split; cross-attention
                                            to it runs per token, locally
the blocks (a ``ModuleList`` holding        ``Block`` on each (its first argument the activation); their
attention modules) after the token split    self-attention modules get ``Heads()``; cross-attention
                                            (``is_cross_attention``, or named ``*attn2``, ``*cross*``, ``*_to_*``) none
a module whose token input is split and     a ``Block`` of its own (diffusers' split at each attention and
its output gathered                         feed-forward): ``Heads()`` on it if it is self-attention
==========================================  ===========================================================

What cannot be derived is refused at ``parallelize``, naming the entry: an input without ``expected_dims`` (its
layout is unknown), a ``ContextParallelInput`` list on one argument, and joint attention: a self-attention module
that projects the text's queries itself (``add_q_proj``: Flux, whose ``_cp_plan`` splits the text and its ids with
the image tokens) needs ``Heads(joint=...)`` and the text whole, which a ``_cp_plan`` does not say. ``parallelize``
logs one line when it uses a derived plan.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dsp_plugin.plan.spec import Block, Gather, Heads, Layout, Split

__all__ = ["plan_from_cp_plan"]

_TOKENS = "hidden_states"


def _layout(dims: int | None, at: int, where: str, tag: str) -> str:
    if dims is None:
        raise ValueError(f"parallelize: _cp_plan entry {where}: expected_dims is None, so the layout of the tensor "
                         f"is unknown; pass plan= (docs/models.md, 'a plan for your own model')")
    at = at % dims
    return " ".join("L" if i == at else f"{tag}{i}" for i in range(dims))


def _is_attention(module: nn.Module) -> bool:
    return hasattr(module, "processor") and hasattr(module, "set_processor")


def _is_self_attention(path: str, module: nn.Module) -> bool:
    """Self-attention, where diffusers' processors pass their parallel config (Ulysses): by the module's own flag,
    else by diffusers' names (``attn1`` self; ``attn2``, ``*cross*`` and ``a_to_b`` cross)."""
    cross = getattr(module, "is_cross_attention", None)
    if isinstance(cross, bool):
        return not cross
    name = path.rsplit(".", 1)[-1]
    return not (name.endswith("attn2") or "cross" in name or "_to_" in name)


def _entries(cp_plan: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(module path, argument name / output index / "out", ContextParallelInput or Output) for every entry."""
    found = []
    for path, spec in cp_plan.items():
        if isinstance(spec, dict):
            for key, value in spec.items():
                if isinstance(value, (list, tuple)):
                    raise ValueError(f"parallelize: _cp_plan entry {path!r}[{key!r}] lists {len(value)} splits of "
                                     f"one argument; a derived plan takes one; pass plan=")
                found.append((path, key, value))
        else:
            for value in spec if isinstance(spec, (list, tuple)) else [spec]:
                found.append((path, "out", value))
    return found


def _exists(model: nn.Module, path: str) -> bool:
    """Whether ``path`` names a module of ``model`` (``*``: index 0); diffusers' plans name a fixed depth (Helios:
    40 blocks), deeper than a smaller configuration."""
    try:
        model.get_submodule(path.replace(".*", ".0").replace("*", "0"))
    except AttributeError:
        return False
    return True


def _blocks(model: nn.Module, site: str) -> list[str]:
    """The blocks the token split at ``site`` feeds: ``blocks.0`` -> ``blocks.*``; the model itself (``""``) ->
    every ``ModuleList`` child holding attention modules."""
    if site and not site.endswith(".0"):
        return []
    head = site[:-2] if site else None
    return [f"{name}.*" for name, child in model.named_children() if isinstance(child, nn.ModuleList)
            and (head is None or name == head) and any(_is_attention(m) for m in child.modules())]


def plan_from_cp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan ``parallelize`` derives from ``model._cp_plan`` (module docstring), or None without one."""
    cp_plan = getattr(model, "_cp_plan", None)
    if not cp_plan:
        return None
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    entries = [(path, key, value) for path, key, value in _entries(cp_plan) if _exists(model, path)]
    # several outputs gathered (MiniMax-H3's video and audio heads read one sharded activation): each gather keeps the
    # forward sharded for the next, with a reduce-scatter backward (correct for any consumer, one collective more)
    several = sum(isinstance(v, ContextParallelOutput) for _, _, v in entries) > 1
    plan: dict[str, list[Any]] = {}
    sites, gathered = [], set()
    for k, (path, key, value) in enumerate(entries):
        where = f"{path!r}[{key!r}]"
        if isinstance(value, ContextParallelOutput):
            lay = _layout(value.expected_dims, value.gather_dim, where, f"g{k}_")
            plan.setdefault(path, []).append(Gather("out", lay, partial_grad=several))
            gathered.add(path.replace(".*", ".0"))
        elif isinstance(value, ContextParallelInput):
            if isinstance(key, str) and key.startswith("encoder_"):
                continue  # the text stays whole on every rank
            lay = _layout(value.expected_dims, value.split_dim, where, f"s{k}_")
            if value.split_output:  # outputs by index: one Split("out") splits every tensor of the output
                done = [s for s in plan.get(path, []) if isinstance(s, Split) and s.arg == "out"]
                if done and [len(d) for d in done[0].layout.dims] != [len(d) for d in Layout.parse(lay).dims]:
                    raise ValueError(f"parallelize: _cp_plan entry {where} splits an output in another layout than "
                                     f"its other outputs; a derived plan splits them alike; pass plan=")
                if done:
                    continue
            plan.setdefault(path, []).append(Split("out" if value.split_output else key, lay, shard="L"))
            if key == _TOKENS:
                sites.append(path)
        else:
            raise ValueError(f"parallelize: _cp_plan entry {where} is a {type(value).__name__}; expected "
                             f"ContextParallelInput or ContextParallelOutput")
    heads: list[str] = []
    for site in sites:
        # a module whose token input is split and output gathered is a region of its own; else the blocks after it
        regions = [site] if site.replace(".*", ".0") in gathered else _blocks(model, site)
        if not regions:
            raise ValueError(f"parallelize: _cp_plan splits {_TOKENS!r} at {site!r}, and which blocks it feeds is not "
                             f"known (expected a split at the model, at a ModuleList's first block, or around one "
                             f"module); pass plan= (docs/models.md, 'a plan for your own model')")
        for region in regions:
            plan.setdefault(region, []).append(Block("B L D", arg=_TOKENS))  # after a Split of the same module
            module = model.get_submodule(region.replace(".*", ".0"))
            for sub, child in module.named_modules():
                if _is_attention(child) and _is_self_attention(sub or region, child):
                    path = f"{region}.{sub}" if sub else region
                    if getattr(child, "add_q_proj", None) is not None:
                        raise ValueError(
                            f"parallelize: {type(model).__name__} has a _cp_plan but no built-in plan, and its "
                            f"attention {path} is joint (it projects the text's queries itself, add_q_proj: text and "
                            f"tokens attend as one sequence); a plan derived from a _cp_plan keeps the text whole and "
                            f"cannot say where the joint tokens go; pass plan= with Heads(joint='first' or 'last') "
                            f"(docs/models.md, 'Joint attention')")
                    heads.append(path)
    for path in dict.fromkeys(heads):
        plan.setdefault(path, []).append(Heads())
    return {path: specs[0] if len(specs) == 1 else specs for path, specs in plan.items()}
