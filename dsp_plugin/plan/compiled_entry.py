"""The entry check of a compiled parallelized model: every rank's inputs agreed, as in an eager call.

An eager forward of a parallelized model checks, at the first call of each signature, that every rank
of the group was given the same inputs (``_Runtime.check_inputs``, ``comm.agree_inputs``): a host copy
of the inputs and one all_gather. Under torch.compile the model's pre-hook is traced, and a graph can
hold neither, so differing inputs per rank went through silently. So the traced pre-hook calls the check
as an op of the graph, ``dsp_plugin::agree_inputs``: a ``torch.library`` custom op marked as having a side
effect (no pass removes it), opaque to dynamo, AOTAutograd and Inductor. At every compiled call it runs in
Python with the real inputs, and checks them when ``checks`` says so (by default the first call of each
signature: a later call returns after a set lookup; every call under ``DSP_CHECK=1``; never under
``DSP_CHECK=0``), with the eager check's error on every rank. No graph break, ``fullgraph=True`` included.

The arguments reach the op flattened (its schema takes no Python objects): the tensors, the
ints (symbolic under ``dynamic=True``), the floats, and a text, a constant of the graph, that says which
argument each came from and holds the other values (strings, None, bools, the type of any other object).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["check_compiled_inputs"]

# the op, defined with torch.library's low-level API: its Python kernel is called straight from the dispatcher
# (``torch.library.custom_op`` wraps it in Python autograd and dynamo layers, ~4x the cost per call)
_LIBRARY = torch.library.Library("dsp_plugin", "FRAGMENT")
_LIBRARY.define("agree_inputs(Tensor[] tensors, SymInt[] ints, float[] floats, str layout, str kinds, str name, "
                "str group_name, str hint) -> ()")


def _agree_inputs(tensors: list[torch.Tensor], ints: list[int], floats: list[float], layout: str, kinds: str,
                  name: str, group_name: str, hint: str) -> None:
    """The check at run time. Whether to exchange is decided from what a correct program has alike on every
    rank (the arguments' kinds, the tensors' shapes and dtypes), so every rank decides alike."""
    from dsp_plugin import checks

    key = ("compiled inputs", name, group_name, kinds, tuple([(t.shape, t.dtype) for t in tensors]))
    if not checks.needs_check_for(key):
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    from dsp_plugin.comm import agree_inputs

    agree_inputs(name, _values(layout, tensors, ints, floats), group=_resolve_process_group(group_name),
                 hint=hint, every_call=True)
    checks.remember(key)


_LIBRARY.impl("agree_inputs", _agree_inputs, "CompositeExplicitAutograd")


@torch.library.register_fake("dsp_plugin::agree_inputs", lib=_LIBRARY)
def _(tensors: list[torch.Tensor], ints: list[int], floats: list[float], layout: str, kinds: str, name: str,
      group_name: str, hint: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.dsp_plugin.agree_inputs.default)


def check_compiled_inputs(name: str, values: dict[str, Any], group: dist.ProcessGroup, *, hint: str) -> None:
    """Traced (``torch.compiler.is_compiling()``): the op that checks ``values`` (the call's arguments by name)
    on every rank of ``group`` at run time, as ``comm.agree_inputs(name, values, ...)`` does in an eager call.
    ``hint`` (the caller's, ``runtime.INPUT_HINT``) ends the error: passed in, a constant of the graph, so this
    module imports nothing of the runtime that calls it."""
    tensors: list[torch.Tensor] = []
    ints: list[Any] = []
    floats: list[Any] = []
    layout = kinds = ""
    for label, value in values.items():
        counts = (len(tensors), len(ints), len(floats))
        text, kind = _flatten(value, tensors, ints, floats)
        layout += (_field(label) + _field(str(len(tensors) - counts[0])) + _field(str(len(ints) - counts[1]))
                   + _field(str(len(floats) - counts[2])) + _field(text))
        kinds += _field(label) + _field(kind)
    torch.ops.dsp_plugin.agree_inputs(tensors, ints, floats, layout, kinds, name, group.group_name, hint)


def _field(text: str) -> str:
    return str(len(text)) + ":" + text  # length-prefixed: any text, separators included, reads back


def _flatten(value: Any, tensors: list[torch.Tensor], ints: list[Any], floats: list[Any]) -> tuple[str, str]:
    """``value``'s tensors, ints and floats appended to the lists; (the rest as text, its structure included;
    the kind of each value alone, what must be alike on every rank of a correct program)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return "t", "t"
    if value is None or isinstance(value, (bool, str)):
        return "=" + _field(str(value)), type(value).__name__
    if isinstance(value, (int, torch.SymInt)):
        ints.append(value)
        return "i", "i"
    if isinstance(value, (float, torch.SymFloat)):
        floats.append(value)
        return "f", "f"
    if isinstance(value, (tuple, list, dict)):
        keys = list(value.keys()) if isinstance(value, dict) else []
        parts = [_flatten(v, tensors, ints, floats) for v in (value.values() if isinstance(value, dict) else value)]
        texts = "".join(_field(str(k)) for k in keys) + "".join(_field(text) for text, _ in parts)
        kinds = "".join(_field(str(k)) for k in keys) + "".join(_field(kind) for _, kind in parts)
        return "(" + texts, "(" + kinds
    return "<" + type(value).__qualname__, "<" + type(value).__qualname__


def _values(layout: str, tensors: list[torch.Tensor], ints: list[int], floats: list[float]) -> dict[str, Any]:
    """The arguments by name again, each as (its text, its tensors, its ints, its floats): what ``agree_inputs``
    hashes per argument (the same on every rank exactly when the ranks' arguments are alike)."""
    fields, at = [], 0
    while at < len(layout):
        colon = layout.index(":", at)
        size = int(layout[at:colon])
        fields.append(layout[colon + 1:colon + 1 + size])
        at = colon + 1 + size
    values, taken = {}, [0, 0, 0]
    for i in range(0, len(fields), 5):
        label, n_tensors, n_ints, n_floats, text = fields[i:i + 5]
        parts = []
        for k, (items, count) in enumerate(((tensors, n_tensors), (ints, n_ints), (floats, n_floats))):
            parts.append(tuple(items[taken[k]:taken[k] + int(count)]))
            taken[k] += int(count)
        values[label] = (text, *parts)
    return values
