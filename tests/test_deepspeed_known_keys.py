"""A DeepSpeed config's top-level keys against the keys DeepSpeed itself reads (issue 52, silent 4).

DeepSpeed ignores a top-level key it does not know: ``"zero_optimisation": {"stage": 3}`` trained at the
launch config's ZeRO stage without a word. Now a near miss of one of DeepSpeed's keys is refused with a
did-you-mean from the config alone (so alike on every rank, before any collective) and any other unknown
key is warned about. No processes.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]


def _config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_mode": "dsp", "sequence_parallel_size": 2,
            "zero_optimization": {"stage": 2}, **extra}


def test_the_keys_are_deepspeeds_own() -> None:
    """Read from DeepSpeed's config reader: its sections (read through ``.keys()`` or behind a truthiness
    test) are there, the misspelling is not; every shipped config's keys are known."""
    from dsp_plugin.deepspeed.known_keys import deepspeed_top_level_keys

    keys = deepspeed_top_level_keys()
    assert keys is not None
    for key in ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16", "activation_checkpointing",
                "flops_profiler", "autotuning", "gradient_clipping", "train_batch_size", "sequence_parallel_size"):
        assert key in keys, key
    assert "zero_optimisation" not in keys
    for path in [ROOT / "launch" / "ds_config_dsp.json", ROOT / "dsp_plugin" / "launch" / "ds_config_dsp.json"]:
        extra = set(json.loads(path.read_text())) - keys - {"sequence_parallel_mode"}
        assert not extra, (path, extra)


@pytest.mark.parametrize(("typo", "meant"), [("zero_optimisation", "zero_optimization"),
                                             ("gradient_clip", "gradient_clipping"),
                                             ("train_micro_batch_size_per_gpus", "train_micro_batch_size_per_gpu")])
def test_a_misspelled_deepspeed_key_is_refused_with_a_did_you_mean(typo: str, meant: str) -> None:
    from dsp_plugin.deepspeed import parse_dsp_config

    with pytest.raises(ValueError, match=f"unknown key '{typo}'; did you mean '{meant}'"):
        parse_dsp_config(_config(**{typo: {"stage": 3}}), world_size=2)


def test_another_unknown_key_is_warned_about_and_a_good_config_is_quiet() -> None:
    from dsp_plugin.deepspeed import parse_dsp_config

    with pytest.warns(UserWarning, match=r"unknown top-level key\(s\) \['my_notes'\]"):
        assert parse_dsp_config(_config(my_notes="run 7"), world_size=2) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_dsp_config(json.loads((ROOT / "launch" / "ds_config_dsp.json").read_text()), world_size=2)


def test_the_launch_refuses_it_before_any_collective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dsp-train-deepspeed``'s preflight (every rank, before ``init_distributed``) raises it."""
    from dsp_plugin.launch.train_deepspeed import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = json.loads((ROOT / "launch" / "ds_config_dsp.json").read_text())
    config["zero_optimisation"] = config.pop("zero_optimization") | {"stage": 3}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "ds.json"), frames=8, size=8, save_dir=None,
                              losses_json=None, load_dir=None)
    with pytest.raises(ValueError, match="did you mean 'zero_optimization'"):
        preflight(args)
