"""The top-level keys DeepSpeed's config reads, taken from DeepSpeed itself, and the user's keys checked against them.

DeepSpeed ignores a top-level key it does not know, so ``"zero_optimisation": {"stage": 3}`` trains
at ZeRO stage 0 (or the stage of the launch's own config) without a word. Its nested sections are
pydantic models that refuse unknown fields; only the top level is lax.

The keys are not a hand list: ``DeepSpeedConfig._initialize_params`` (and its warning check) runs
once on an empty dict that records every key it asks for (``get``, ``[]``, ``in``, ``in
.keys()``), so the set follows the installed DeepSpeed (0.19.8 is pinned and tested). Added to it:
the keys DeepSpeed itself refuses as removed (its own message says what replaced them), the mesh
keys ``deepspeed.initialize`` reads (``sequence_parallel_size``, ``data_parallel_size``) and ours.

``check_top_level_keys`` raises for a key that is a near miss of a known one (a did-you-mean: a
typo changes the training in silence) and warns, on every rank, for any other unknown key (a
user's own annotation, or a key of another DeepSpeed version). It reads only the config.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["check_top_level_keys", "deepspeed_top_level_keys"]

#: read by ``deepspeed.initialize`` (its Ulysses mesh), not by ``DeepSpeedConfig``
_INITIALIZE_KEYS = ("sequence_parallel_size", "data_parallel_size")


class _Keys:
    """The ``keys()`` view of ``_Recording``: membership tests are recorded too."""

    def __init__(self, owner: _Recording) -> None:
        self.owner = owner

    def __contains__(self, key: object) -> bool:
        return key in self.owner

    def __iter__(self) -> Iterator[Any]:
        return iter(dict.keys(self.owner))


class _Recording(dict):
    """An empty config that remembers every key DeepSpeed asks it for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.asked.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def __bool__(self) -> bool:  # readers that test ``if param_dict and KEY in param_dict`` read on
        return True

    def keys(self) -> _Keys:  # type: ignore[override]
        return _Keys(self)

    def __copy__(self) -> _Recording:
        return self


@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset[str] | None:
    """Every top-level key the installed DeepSpeed reads (see the module docstring); None if it cannot be read."""
    try:
        from deepspeed.runtime import config as ds_config
    except ImportError:
        return None
    recording = _Recording()
    reader = ds_config.DeepSpeedConfig.__new__(ds_config.DeepSpeedConfig)
    reader._param_dict = recording
    try:
        reader._initialize_params(recording)
        reader._do_warning_check()
    except Exception as exc:  # noqa: BLE001 - another DeepSpeed's reader: no check rather than a wrong one
        warnings.warn(f"dsp_plugin: cannot read DeepSpeed's config keys ({type(exc).__name__}: {exc}); "
                      f"unknown top-level keys are not checked", stacklevel=2)
        return None
    removed = getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    return frozenset(k for k in (*recording.asked, *removed, *_INITIALIZE_KEYS) if isinstance(k, str))


def check_top_level_keys(config: Mapping[str, Any], ours: Iterable[str] = ()) -> list[str]:
    """Refuse a near miss of a DeepSpeed key (``ValueError`` with a did-you-mean); warn for any other unknown key.

    ``ours``: this package's keys, known too. Returns the unknown keys warned about."""
    deepspeed_keys = deepspeed_top_level_keys()
    if deepspeed_keys is None:
        return []
    known = deepspeed_keys | set(ours)
    unknown = [k for k in config if k not in known]
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.8)
        if close:
            raise ValueError(f"DeepSpeed config: unknown key {key!r}; did you mean {close[0]!r}? (DeepSpeed ignores "
                             f"a top-level key it does not know, so the run would go on without this setting)")
    if unknown:
        warnings.warn(f"DeepSpeed config: unknown top-level key(s) {unknown}: DeepSpeed "
                      f"{_version()} does not read them, so they change nothing", stacklevel=3)
    return unknown


def _version() -> str:
    import deepspeed

    return str(deepspeed.__version__)
