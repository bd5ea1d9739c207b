"""``dsp-sample``: ``--timeout`` and a ``--model DIR`` video size its pipeline cannot take are refused by name, one
line and exit 2, before any process starts or a weight is loaded (issue 52, unclear 7 and 8).

The directory holds only the JSON files ``save_pretrained`` writes for the tiny Wan and Latte pipelines
(``dsp_plugin.testing.tiny``: their configs' values); the limits the message names are checked against
diffusers' own ``WanRotaryPosEmbed`` of that transformer (the largest size named passes it, one more fails).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

#: what save_pretrained writes for tiny_wan_pipeline / tiny_latte_pipeline (the size-relevant keys)
WAN = {"model_index.json": {"_class_name": "WanPipeline"},
       "transformer/config.json": {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2],
                                   "rope_max_seq_len": 32},
       "vae/config.json": {"_class_name": "AutoencoderKLWan", "scale_factor_spatial": 2, "scale_factor_temporal": 2}}
LATTE = {"model_index.json": {"_class_name": "LattePipeline"},
         "transformer/config.json": {"_class_name": "LatteTransformer3DModel", "patch_size": 2, "video_length": 7}}


def _directory(tmp: Path, files: dict[str, dict]) -> Path:
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(json.dumps(data))
    return tmp


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from dsp_plugin.launch import sample

    with pytest.raises(SystemExit) as exc:
        sample.main(argv)      # with --dsp 2 a process would be spawned if the check came later
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("dsp-sample: error: "), err
    return err


@pytest.mark.parametrize("timeout", ["0", "-5", "inf"])
def test_timeout_must_be_positive(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["--model", "tiny-wan", "--dsp", "2", "--timeout", timeout], capsys)
    assert f"--timeout {float(timeout):g}: expected a positive number of seconds" in err, err


def test_wan_directory_default_sizes_name_the_rope_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: default sizes (81 frames, 480x832) on a saved tiny Wan, whose RoPE has 32 positions."""
    directory = _directory(tmp_path, WAN)
    err = _refused(["--model", str(directory), "--dsp", "2"], capsys)
    assert ("--num-frames 81 (the default for a pipeline directory) gives 41 tokens, --height 480 (the default "
            "for a pipeline directory) gives 120 tokens, --width 832 (the default for a pipeline directory) gives "
            "208 tokens along that axis, more than its transformer's rope_max_seq_len 32") in err, err
    assert "expected --num-frames <= 63, --height <= 128, --width <= 128" in err, err
    err = _refused(["--model", str(directory), "--dsp", "2", "--num-frames", "9", "--height", "16", "--width",
                    "144"], capsys)
    assert "--width 144 gives 36 tokens along that axis" in err and "expected --width <= 128" in err, err
    err = _refused(["--model", str(directory), "--dsp", "4", "--num-frames", "5", "--height", "16", "--width",
                    "16"], capsys)
    assert "--num-frames 5 gives 3 latent frames, fewer than --dsp 4; expected --num-frames >= 7" in err, err
    err = _refused(["--model", str(directory), "--num-frames", "9", "--height", "24", "--width", "16"], capsys)
    assert "--height 24; a WanPipeline takes a multiple of 16 pixels" in err, err


def test_the_named_limits_are_diffusers_own() -> None:
    """The tiny Wan transformer's RoPE takes the largest sizes the message names and refuses one token more."""
    from dsp_plugin.testing.tiny import tiny_wan

    rope = tiny_wan().rope
    assert rope.max_seq_len == WAN["transformer/config.json"]["rope_max_seq_len"]
    latent = (63 - 1) // 2 + 1, 128 // 2, 128 // 2                       # --num-frames 63, 128 x 128 pixels
    rope(torch.zeros(1, 4, *latent))
    for more in ((latent[0] + 1, 16, 16), (1, latent[1] + 2, 16), (1, 16, latent[2] + 2)):
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            rope(torch.zeros(1, 4, *more))


def test_latte_directory_takes_its_video_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dsp_plugin.launch import sample

    directory = _directory(tmp_path, LATTE)
    err = _refused(["--model", str(directory), "--num-frames", "16"], capsys)
    assert "--num-frames 16, but its LatteTransformer3DModel has video_length 7" in err, err
    assert "expected --num-frames 7" in err, err
    args = sample.build_parser().parse_args(["--model", str(directory), "--height", "16", "--width", "16"])
    sample.check_args(args, None)
    assert args.num_frames == 7            # the default: the frames its temporal position table holds
