"""``dsp-sample`` (``python -m dsp_plugin.launch.sample``) writes the video of diffusers' one-process pipeline.

Oracle: the unmodified ``WanPipeline`` / ``LattePipeline`` built here and called on one process with the
same arguments, its frames written with diffusers' ``export_to_video``. The command's frames (``--output
.pt``, before encoding) are compared to the oracle's, and its mp4 decoded and compared to the oracle's mp4
decoded. The progress bar is printed by rank 0 only (torchrun's per-rank logs). Argument errors are one line,
before any process starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
WAN = {"prompt": "a cat walks on the grass", "negative_prompt": "blurry", "height": 16, "width": 16,
       "num_frames": 9, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 16}


def _command(args: list[str], nproc: int = 0, log_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), DSP_BACKEND="gloo")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if log_dir is not None:
        launcher += ["--log-dir", str(log_dir), "--redirects", "3"]
    cmd = [*(launcher if nproc else [sys.executable]), "-m", "dsp_plugin.launch.sample", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _decoded(path: Path) -> np.ndarray:
    import imageio

    with imageio.get_reader(str(path), format="FFMPEG") as reader:
        return np.stack([frame for frame in reader.iter_data()])


def _wan_reference(tmp_path: Path) -> tuple[np.ndarray, Path]:
    from diffusers.utils import export_to_video

    from dsp_plugin.testing.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(layers=2)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(**WAN, generator=torch.Generator().manual_seed(0), output_type="np").frames
    ref = tmp_path / "one.mp4"
    export_to_video(list(frames[0]), str(ref), fps=8)
    return frames, ref


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [False, True])
def test_torchrun_tiny_wan_mp4_equals_one_process(tmp_path: Path, cfg: bool) -> None:
    expected, ref_mp4 = _wan_reference(tmp_path)
    out = tmp_path / "out"
    done = _command(["--model", "tiny-wan", "--output", str(out / "v.mp4"), "--output", str(out / "v.pt"),
                     *(["--cfg-parallel"] if cfg else [])], nproc=2, log_dir=tmp_path / "logs")
    logs = {r: (next((tmp_path / "logs").rglob(f"{r}/stderr.log")).read_text()) for r in (0, 1)}
    assert done.returncode == 0, done.stderr[-3000:] + logs[0][-3000:] + logs[1][-3000:]
    layout = "cfg(2) x dsp(1)" if cfg else "dsp(2)"
    assert f"dsp-sample: tiny-wan, 2 process(es): {layout}, 9 frames 16x16, 4 steps" in logs[0], logs[0]
    assert "4/4 [" in logs[0] and "4/4 [" not in logs[1], (logs[0][-500:], logs[1][-500:])   # the bar: rank 0
    assert "dsp-sample" not in logs[1], logs[1]                    # the dsp_plugin logger: rank 0 only
    frames = torch.load(out / "v.pt", weights_only=True).numpy()
    assert frames.shape == expected.shape == (1, 9, 16, 16, 3)
    diff = np.abs(frames - expected).max()
    print(f"tiny-wan, 2 processes {layout}: frames max |diff| {diff:.3g} vs one process")
    assert diff == 0, diff                   # fp32, bitwise: see docs/inference.md (Wan's halves are batch B)
    mine, ref = _decoded(out / "v.mp4"), _decoded(ref_mp4)
    assert mine.shape == ref.shape and (mine == ref).all(), np.abs(mine.astype(int) - ref).max()


@pytest.mark.slow
def test_torchrun_tiny_wan_vae_tiling_equals_one_process(tmp_path: Path) -> None:
    """``--vae-tiling``: the tiny VAE's 2x2 tiles split over 2 ranks; the frames are one process's, tiled alike."""
    from dsp_plugin.launch.sample import TINY_WAN_TILES
    from dsp_plugin.testing.tiny import tiny_wan_pipeline

    done = _command(["--model", "tiny-wan", "--vae-tiling", "--output", str(tmp_path / "v.pt")], nproc=2,
                    log_dir=tmp_path / "logs")
    log = next((tmp_path / "logs").rglob("0/stderr.log")).read_text()
    assert done.returncode == 0, done.stderr[-3000:] + log[-3000:]
    assert "dsp(2), VAE tiles 12x12 at stride 8x8, 9 frames 16x16" in log, log[-2000:]
    pipe = tiny_wan_pipeline(layers=2)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling(**TINY_WAN_TILES)
    expected = pipe(**WAN, generator=torch.Generator().manual_seed(0), output_type="np").frames
    frames = torch.load(tmp_path / "v.pt", weights_only=True).numpy()
    diff = np.abs(frames - expected).max()
    print(f"tiny-wan --vae-tiling, 2 processes dsp(2): frames max |diff| {diff:.3g} vs one process, tiled alike")
    assert frames.shape == expected.shape and diff == 0, diff


@pytest.mark.slow
def test_spawned_tiny_latte_gif_and_frames_equal_one_process(tmp_path: Path) -> None:
    """No torchrun: ``--dsp 2`` starts 2 processes itself; the .gif's frames are the one-process frames'."""
    from PIL import Image

    from dsp_plugin.testing.tiny import tiny_latte_pipeline, tiny_prompt_embeds

    done = _command(["--model", "tiny-latte", "--dsp", "2", "--steps", "3", "--output", str(tmp_path / "v.gif"),
                     "--output", str(tmp_path / "v.pt")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dsp-sample: tiny-latte, 2 process(es): dsp(2), 7 frames 16x16, 3 steps" in done.stderr, done.stderr
    pipe = tiny_latte_pipeline(frames=7, sample_size=8)
    pipe.set_progress_bar_config(disable=True)
    prompt, negative = tiny_prompt_embeds()
    expected = pipe(prompt_embeds=prompt, negative_prompt=None, negative_prompt_embeds=negative, video_length=7,
                    height=16, width=16, num_inference_steps=3, guidance_scale=4.0, output_type="np",
                    generator=torch.Generator().manual_seed(0)).frames
    frames = torch.load(tmp_path / "v.pt", weights_only=True).numpy()
    diff = np.abs(frames - expected).max()
    print(f"tiny-latte, 2 processes dsp(2): frames max |diff| {diff:.3g} vs one process")
    assert diff < 1e-5, diff
    gif = Image.open(tmp_path / "v.gif")
    assert gif.n_frames == 7 and gif.size == (16, 16)


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "tiny-vae"], "--model tiny-vae: expected one of tiny-wan, tiny-latte or a directory with "
                              "model_index.json"),
    (["--output", "v.avi"], "--output v.avi: expected a file ending in .mp4, .gif, .pt"),
    (["--cfg-parallel", "--guidance", "1"], "--cfg-parallel with --guidance 1.0: guidance <= 1 turns "
                                            "classifier-free guidance off"),
    (["--dsp", "4", "--num-frames", "5"], "--num-frames 5 gives 3 latent frames, fewer than --dsp 4; expected "
                                          "--num-frames >= 7"),
    (["--steps", "0"], "--steps 0: expected a positive integer"),
    (["--model", "tiny-latte", "--vae-tiling"], "--vae-tiling with --model tiny-latte: the tiles are Wan's"),
    (["--output", "/proc/v.mp4"], "--output '/proc' cannot be written"),  # checked before any process
])
def test_argument_errors_are_one_line_before_any_process(args: list[str], message: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    from dsp_plugin.launch import sample

    with pytest.raises(SystemExit) as exc:
        sample.main(args)                  # a process would be spawned (--dsp 4) if the check came later
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("dsp-sample: error: "), err
    assert message in err, err


def test_torchrun_world_must_match_dsp(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from dsp_plugin.launch import sample

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        sample.main(["--dsp", "3"])
    assert "--dsp 3 != the torchrun world 4; expected --nproc-per-node 3 or --dsp 4" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture) -> None:
    from dsp_plugin import __version__
    from dsp_plugin.launch import sample

    with pytest.raises(SystemExit):
        sample.main(["--version"])
    assert capsys.readouterr().out.strip() == f"dsp-sample (dsp_plugin) {__version__}"


@pytest.mark.slow
def test_model_directory_from_save_pretrained(tmp_path: Path) -> None:
    """``--model DIR``: a WanPipeline written by ``--save-pretrained`` and loaded by diffusers' from_pretrained,
    sampled by 2 processes ``dsp-sample`` starts itself, equals the one-process pipeline diffusers loads from the
    same directory (not the pipeline built in memory: transformers loads the text encoder with its SDPA attention,
    built from a config it runs the eager one, 6.6e-7 apart in the frames)."""
    from diffusers import WanPipeline

    saved = _command(["--model", "tiny-wan", "--steps", "1", "--save-pretrained", str(tmp_path / "pipe")])
    assert saved.returncode == 0 and (tmp_path / "pipe" / "model_index.json").is_file(), saved.stderr[-3000:]
    pipe = WanPipeline.from_pretrained(str(tmp_path / "pipe"))
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(**WAN, generator=torch.Generator().manual_seed(0), output_type="np").frames
    done = _command(["--model", str(tmp_path / "pipe"), "--dsp", "2", "--height", "16", "--width", "16",
                     "--num-frames", "9", "--max-sequence-length", "16", "--output", str(tmp_path / "v.pt")])
    assert done.returncode == 0, done.stderr[-3000:]
    frames = torch.load(tmp_path / "v.pt", weights_only=True).numpy()
    assert np.abs(frames - expected).max() == 0
