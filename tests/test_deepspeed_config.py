"""The DSP key in a DeepSpeed config: parsing, and clear errors for bad configs (no processes).

Errors must come from the config alone, so every rank raises the same one
before any collective; the last test checks that on two real ranks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dsp_plugin.deepspeed import DeepSpeedMPU, initialize, load_config, parse_dsp_config
from dsp_plugin.deepspeed_env import deepspeed_version_is_tested, require_tested_deepspeed
from tests.distributed import WorkerError, run_distributed
from tests.deepspeed_harness import setup_worker

LAUNCH_CONFIG = Path(__file__).resolve().parents[1] / "launch" / "ds_config_dsp.json"


def _config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_mode": "dsp",
                              "sequence_parallel_size": 2, "zero_optimization": {"stage": 2}}
    config.update(overrides)
    return config


def test_key_parses_size_and_stage() -> None:
    settings = parse_dsp_config(_config(), world_size=4)
    assert settings is not None
    assert (settings.size, settings.zero_stage, settings.reduce_scatter) == (2, 2, True)


def test_without_the_mode_key_deepspeed_is_untouched() -> None:
    # DeepSpeed's own Ulysses keys alone are not ours to interpret.
    assert parse_dsp_config({"sequence_parallel_size": 2, "data_parallel_size": 2}, world_size=4) is None


@pytest.mark.parametrize("overrides, world_size, message", [
    ({"sequence_parallel_size": 3}, 4, "world size 4 is not divisible by tp(1) * dsp(3)"),
    ({"sequence_parallel_mode": "ulysses"}, 4, "unknown 'sequence_parallel_mode' 'ulysses'; expected one of ['dsp']"),
    ({"sequence_parallel_mode": None}, 4, "unknown 'sequence_parallel_mode' None"),
    ({"data_parallel_size": 2}, 4, "cannot be combined with DeepSpeed's Ulysses mesh key(s) ['data_parallel_size']"),
    ({"sequence_parallel_size": 0}, 4, "'sequence_parallel_size' must be a positive int, got 0"),
    ({"sequence_parallel_size": "2"}, 4, "'sequence_parallel_size' must be a positive int, got '2'"),
    ({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 4, "needs zero_optimization.reduce_scatter=true"),
    ({"zero_optimization": {"stage": 5}}, 4, "stage must be 0, 1, 2 or 3, got 5"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, 4, "mics_shard_size=2"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, 4, "zero_hpz_partition_size=2"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, 4,
     "zero_quantized_gradients=true is not supported with DSP"),
    ({"tensor_parallel": {"autotp_size": 2}}, 4, "tensor_parallel.autotp_size=2 cannot be combined with DSP"),
])
def test_bad_config_names_the_value(overrides: dict[str, Any], world_size: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_dsp_config(_config(**overrides), world_size=world_size)
    assert message in str(info.value)


def test_missing_size_is_an_error() -> None:
    config = _config()
    del config["sequence_parallel_size"]
    with pytest.raises(ValueError, match="needs 'sequence_parallel_size'"):
        parse_dsp_config(config, world_size=4)


def test_initialize_refuses_a_second_mpu_or_mesh() -> None:
    # Raised before torch.distributed is touched: nothing to clean up.
    with pytest.raises(ValueError, match="supplies its own mpu"):
        initialize(model=object(), mpu=object(), config=_config())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Ulysses mesh"):
        initialize(model=object(), mesh_param=(2, 2), config=_config())  # type: ignore[arg-type]


def test_without_the_key_deepspeed_is_reached_untouched() -> None:
    """No key: nothing of ours runs, not even the shared-memory op skip; DeepSpeed's own check answers."""
    import deepspeed.ops

    from dsp_plugin.topology import get_topology

    ops = deepspeed.ops.__compatible_ops__
    sentinel, saved = object(), ops.get("deepspeed_shm_comm")
    ops["deepspeed_shm_comm"] = sentinel
    try:
        with pytest.raises(AssertionError, match="deepspeed.initialize requires a model"):
            initialize(model=None, config={"train_batch_size": 1})
        assert ops["deepspeed_shm_comm"] is sentinel
    finally:
        ops["deepspeed_shm_comm"] = saved
    assert get_topology() is None


def test_untested_deepspeed_is_refused() -> None:
    require_tested_deepspeed()  # the installed one (constraints.txt)
    require_tested_deepspeed("0.19.8+cu124")
    for version in ("0.19.7", "0.19.9", "0.20.0"):
        with pytest.raises(RuntimeError, match=rf"DeepSpeed {version} is outside the tested range "
                                               rf">=0\.19\.8,<0\.19\.9"):
            require_tested_deepspeed(version)
    assert not deepspeed_version_is_tested("0.20.0")


def test_config_found_like_deepspeed_finds_it(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config()))
    args = argparse.Namespace(deepspeed_config=str(path))
    assert load_config(args=args)["sequence_parallel_mode"] == "dsp"
    assert load_config(config=str(path)) == load_config(config_params=_config())


def test_launch_config_carries_the_key() -> None:
    config = load_config(config=str(LAUNCH_CONFIG))
    settings = parse_dsp_config(config, world_size=4)
    assert settings is not None and settings.size == 2


def test_mpu_has_no_ulysses_marker() -> None:
    # DeepSpeed ignores the DP getters of an mpu that has initialize_sequence_parallel.
    assert not hasattr(DeepSpeedMPU, "initialize_sequence_parallel")


def _bad_size_worker(rank: int, world_size: int) -> str:
    setup_worker(rank, world_size)
    from dsp_plugin.models import STDiT, STDiTConfig

    initialize(model=STDiT(STDiTConfig.preset("tiny")), config=_config(sequence_parallel_size=3))
    return "no error"


@pytest.mark.slow
def test_bad_size_raises_on_every_rank_without_hanging() -> None:
    with pytest.raises(WorkerError) as info:
        run_distributed(_bad_size_worker, 2, timeout=120)
    text = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank} raised ValueError: DeepSpeed config: sequence_parallel_size=3" in text
