"""The DeepSpeed config key that turns DSP on, read and checked before any collective.

The key mirrors Megatron's ``--sequence-parallel-mode dsp`` and reuses
DeepSpeed's own size key::

    "sequence_parallel_mode": "dsp",
    "sequence_parallel_size": 4,
    "sequence_parallel_comm_dtype": "fp8"      (optional; Megatron's --dsp-comm-dtype)

``sequence_parallel_comm_dtype: "fp8"`` sends the switches and head switches of a
model made parallel by ``dsp_plugin.parallelize`` as float8 e4m3 with a scale per
chunk (``dsp_plugin.comm.payload``); absent or null, in the activations' dtype.

Why these two keys rather than a ``"dsp": {...}`` section: ``sequence_parallel_size``
already means "ranks that share one sample" to DeepSpeed (its batch arithmetic
divides the world by it), so the batch sizes in a config stay correct whether
DSP or DeepSpeed-Ulysses consumes it; the mode key only says which algorithm
uses those ranks. Without the mode key nothing here applies and DeepSpeed runs
unchanged.

Every other top-level key is checked against the keys DeepSpeed itself reads
(``known_keys``): ``"zero_optimisation"`` is refused with a did-you-mean, since
DeepSpeed would ignore it and train without it.

Every check below needs only the config and the world size, never a
collective, so a bad config raises the same ``ValueError`` on every rank and
no rank is left waiting in a rendezvous.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsp_plugin.deepspeed.known_keys import check_top_level_keys
from dsp_plugin.topology import validate_sizes

__all__ = ["COMM_DTYPES", "COMM_DTYPE_KEY", "MODES", "MODE_KEY", "SIZE_KEY", "ULYSSES_MESH_KEYS", "DSPSettings",
           "parse_dsp_config", "require_dsp_config"]

MODE_KEY = "sequence_parallel_mode"
SIZE_KEY = "sequence_parallel_size"
COMM_DTYPE_KEY = "sequence_parallel_comm_dtype"
COMM_DTYPES = ("fp8",)
#: With ``sequence_parallel_size`` this makes ``deepspeed.initialize`` build its own
#: (data_parallel, sequence_parallel) device mesh, which reduces gradients over DP
#: only; DeepSpeed's groups would then shadow the DSP ones.
ULYSSES_MESH_KEYS = ("data_parallel_size",)
MODES = ("dsp",)


@dataclass(frozen=True)
class DSPSettings:
    """What the key asks for: the DSP size and the ZeRO settings the gradient fix depends on."""

    size: int
    zero_stage: int
    reduce_scatter: bool
    comm_dtype: str | None = None   # the switches' wire format (``COMM_DTYPE_KEY``); None: the activations' dtype


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DeepSpeed config: {name!r} must be a positive int, got {value!r}")
    return value


def _near_miss(key: str, config: Mapping[str, Any]) -> str | None:
    """A key of ``config`` that looks like a misspelled ``key`` (not ``key`` itself), or None."""
    if key in config:
        return None
    candidates = [k for k in config if isinstance(k, str) and k not in (MODE_KEY, SIZE_KEY, COMM_DTYPE_KEY)]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.85)
    return close[0] if close else None


def _refuse_near_misses(config: Mapping[str, Any]) -> None:
    for key in (MODE_KEY, SIZE_KEY, COMM_DTYPE_KEY):
        typo = _near_miss(key, config)
        if typo is not None:
            raise ValueError(f"DeepSpeed config: unknown key {typo!r}; did you mean {key!r}? (DeepSpeed ignores "
                             f"unknown keys, so without the fix DSP would be off and a DSP-aware model refused)")


def require_dsp_config(config: Mapping[str, Any], *, world_size: int | None = None,
                       who: str = "this script") -> DSPSettings:
    """``parse_dsp_config`` for a script that only trains with DSP: a config without the key is an error."""
    settings = parse_dsp_config(config, world_size=world_size)
    if settings is None:
        raise ValueError(f"DeepSpeed config: {who} trains with DSP, but the config has no {MODE_KEY!r} key; "
                         f"add \"{MODE_KEY}\": \"dsp\" and \"{SIZE_KEY}\": N (launch/ds_config_dsp.json "
                         f"has both)")
    return settings


def parse_dsp_config(config: Mapping[str, Any], *, world_size: int | None = None) -> DSPSettings | None:
    """Return the DSP settings, or None when the config does not ask for DSP.

    ``world_size=None`` skips the divisibility check (used before
    torch.distributed exists); every other check runs regardless.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"DeepSpeed config: expected a dict, got {type(config).__name__}")
    _refuse_near_misses(config)
    # DeepSpeed's own keys (read from DeepSpeed): a near miss refused, any other unknown key warned about
    check_top_level_keys(config, ours=(MODE_KEY, SIZE_KEY, COMM_DTYPE_KEY))
    if MODE_KEY not in config:
        if config.get(COMM_DTYPE_KEY) is not None:
            raise ValueError(f"DeepSpeed config: {COMM_DTYPE_KEY!r}: {config[COMM_DTYPE_KEY]!r} needs "
                             f"{MODE_KEY!r}: 'dsp' (without it nothing is switched)")
        return None
    mode = config[MODE_KEY]
    if mode not in MODES:
        raise ValueError(f"DeepSpeed config: unknown {MODE_KEY!r} {mode!r}; expected one of {list(MODES)} "
                         f"(leave the key out to run DeepSpeed's own sequence parallelism)")
    if SIZE_KEY not in config:
        raise ValueError(f"DeepSpeed config: {MODE_KEY!r}: {mode!r} needs {SIZE_KEY!r}, the number of ranks "
                         f"that share one sample (the DSP size)")
    size = _positive_int(SIZE_KEY, config[SIZE_KEY])
    clashing = [key for key in ULYSSES_MESH_KEYS if key in config]
    if clashing:
        raise ValueError(f"DeepSpeed config: {MODE_KEY!r}: {mode!r} cannot be combined with DeepSpeed's Ulysses "
                         f"mesh key(s) {clashing} (with {SIZE_KEY!r} they build a (data_parallel, "
                         f"sequence_parallel) mesh that reduces gradients over DP only); remove them: "
                         f"DSP takes data parallelism as world size / {SIZE_KEY}")
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise TypeError(f"DeepSpeed config: 'zero_optimization' must be a dict, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    reduce_scatter = bool(zero.get("reduce_scatter", True))
    if stage == 3 and not reduce_scatter:
        # ZeRO-3's all-reduce path averages per bucket: buckets that fit the contiguous
        # buffer sum over SP, larger ones average over DP x SP, so no single factor fixes it.
        raise ValueError("DeepSpeed config: DSP with ZeRO stage 3 needs zero_optimization.reduce_scatter=true "
                         "(the default); with false, DeepSpeed 0.19 scales gradients differently per bucket")
    mics, hpz = zero.get("mics_shard_size", -1), zero.get("zero_hpz_partition_size", 1)
    if (mics or -1) > 0 or (hpz or 1) > 1:
        raise ValueError(f"DeepSpeed config: zero_optimization mics_shard_size={mics!r} / "
                         f"zero_hpz_partition_size={hpz!r} are not supported with DSP (their reduction "
                         f"groups are not measured); remove them")
    if zero.get("zero_quantized_gradients", False):
        # ZeRO++ qgZ reduces gradients with its own all-to-all over the whole world and
        # its own divisor; neither follows the DP x DSP convention, and it is untested here.
        raise ValueError("DeepSpeed config: zero_optimization.zero_quantized_gradients=true is not supported with "
                         "DSP (its quantized reduction bypasses the DP x DSP gradient convention); remove it")
    tensor_parallel = config.get("tensor_parallel") or {}
    autotp = tensor_parallel.get("autotp_size", 0) if isinstance(tensor_parallel, Mapping) else tensor_parallel
    if autotp not in (0, 1, None):
        raise ValueError(f"DeepSpeed config: tensor_parallel.autotp_size={autotp!r} cannot be combined with DSP in "
                         f"the DeepSpeed integration (tp = pp = 1 here); use the Megatron integration for TP x DSP")
    if world_size is not None:
        try:
            validate_sizes(world_size, dsp=size)
        except ValueError as exc:
            raise ValueError(f"DeepSpeed config: {SIZE_KEY}={size} does not fit the world: {exc}") from None
    comm_dtype = config.get(COMM_DTYPE_KEY)
    if comm_dtype is not None and comm_dtype not in COMM_DTYPES:
        raise ValueError(f"DeepSpeed config: {COMM_DTYPE_KEY!r}: {comm_dtype!r}; expected one of "
                         f"{list(COMM_DTYPES)}, or null / no key for the activations' dtype")
    return DSPSettings(size=size, zero_stage=stage, reduce_scatter=reduce_scatter, comm_dtype=comm_dtype)
