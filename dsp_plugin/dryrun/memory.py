"""Peak memory of one step, measured as the tensors come and go: real tensors or fake ones alike.

``MemoryTracker`` is a ``TorchDispatchMode``: every storage an operator creates inside the
block is counted from the op that creates it until the storage is freed (a ``weakref.finalize``
on the storage object, which torch keeps alive exactly as long as the memory), so the running
total is the bytes a caching allocator would have handed out, before its rounding. It keeps
the peak and where it happened: the innermost module running (``ModTracker``'s names,
``Model.blocks.3.ffn``) and whether in forward or backward. Storages that exist before the
block (parameters, buffers) are not counted; pass more to leave out with ``exclude``.

Under ``FakeTensorMode`` the same ops run with no memory, and the count is what a real run
would allocate: ``tests/test_dryrun.py`` holds it against real CPU runs of the same step.
Storages are told apart by ``dsp_plugin.layout.storage_address`` (a fake tensor's data
pointer is always 0). Collectives seen by the mode are remembered with the module that issued
them (``collective_sites``), in the order ``CommAccounting`` records them.

FLOPs (``flops``) are counted in the same pass with torch's own formulas, the registry of
``torch.utils.flop_counter.FlopCounterMode`` (plus the CPU flash-attention kernels SDPA picks
for CPU tensors, with the same formula as the GPU ones). The mode itself is not entered: its
module tracker keeps every activation alive through the backward (measured: a Wan 1.3B step
with full recompute peaked at 10.5 GiB without it and 101.6 GiB inside it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsp_plugin.checks import exchanging
from dsp_plugin.collective_bytes import NAMESPACES, OPS
from dsp_plugin.layout import storage_address

__all__ = ["MemoryTracker", "flop_formulas"]


def flop_formulas() -> dict[Any, Any]:
    """``FlopCounterMode``'s formula per operator, with SDPA's CPU flash kernels added (same formulas)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                 **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}).flop_registry


class MemoryTracker(TorchDispatchMode):
    """``with MemoryTracker() as mt: step()`` -> ``mt.peak`` bytes, ``mt.peak_module``, ``mt.peak_phase``."""

    def __init__(self, *, exclude: Iterable[torch.Tensor] = (), model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self._stack: list[str] = []
        self._paused = 0
        self._handles: list[Any] = []
        if model is not None:
            self._watch(model)
        self._excluded = {storage_address(t) for t in exclude}
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_module = ""
        self.peak_phase = "forward"
        self.collective_sites: list[tuple[str, str]] = []  # (module, phase) of each collective, in order
        self.flops = 0
        self._formulas = flop_formulas()
        self._modules = ModTracker()

    def __enter__(self) -> MemoryTracker:
        self._modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._modules.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _watch(self, model: torch.nn.Module) -> None:
        """A module stack of our own for the forward, whose hooks run around every other hook of each module:
        ``ModTracker``'s global hooks run before a module's own, so a collective issued by a plan's post-hook
        (a block's switch after it) would be charged to its parent."""
        root = type(model).__name__
        for name, module in model.named_modules():
            path = f"{root}.{name}" if name else root
            self._handles.append(module.register_forward_pre_hook(
                lambda m, a, p=path: self._stack.append(p), prepend=True))
            self._handles.append(module.register_forward_hook(
                lambda m, a, o, p=path: self._pop(p), always_call=True))

    def _pop(self, path: str) -> None:
        if self._stack and self._stack[-1] == path:
            self._stack.pop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Storages created inside are not counted: a framework's gradient reduction, whose temporaries
        are its backend's (gloo copies what NCCL reduces in place) and are reported as buffers instead."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Leave these storages out from now on (and drop them from the count if they were in it)."""
        for t in tensors:
            address = storage_address(t)
            self._excluded.add(address)
            self.current -= self._live.pop(address, 0)

    def where(self) -> tuple[str, str]:
        """The innermost module running now (the deepest name; "" outside any) and the phase."""
        backward = torch._C._current_graph_task_id() != -1
        if self._stack and not backward:
            return self._stack[-1], "forward"
        names = [p for p in self._modules.parents if p != "Global"]
        module = max(names, key=lambda name: name.count("."), default="")
        return module, "backward" if backward else "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        if getattr(func, "namespace", None) in NAMESPACES and \
                f"{func.namespace}.{func._schema.name.partition('::')[2]}" in OPS and not exchanging.active():
            self.collective_sites.append(self.where())  # paired with CommAccounting's records (checks kept apart)
        if not self._paused:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._see(t)
        return out

    def _see(self, t: torch.Tensor) -> None:
        address = storage_address(t)
        if address in self._live or address in self._excluded:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        self._live[address] = nbytes
        self.current += nbytes
        weakref.finalize(storage, self._free, address)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_module, self.peak_phase = self.where()

    def _free(self, address: int) -> None:
        self.current -= self._live.pop(address, 0)
