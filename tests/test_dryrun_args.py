"""``python -m dsp_plugin.dryrun``: a bad size, a bad model file or a bad ``--plot`` is refused by name,
exit status 2, before any dry run (issue 52: silent 1, 2; unclear 1-5).

In process: ``main(argv)`` with ``dry_run`` replaced by a stub that fails the test, so "before the work" is
checked, not assumed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def no_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsp_plugin.dryrun import step

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dry run started; the argument should have been refused before it")

    monkeypatch.setattr(step, "dry_run", refuse)


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from dsp_plugin.dryrun.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--text-len", "0"], "--text-len 0: expected a positive integer"),
    (["--text-len", "-5"], "--text-len -5: expected a positive integer"),
    (["--frames", "-3"], "--frames -3: expected a positive integer"),
    (["--frames", "0"], "--frames 0: expected a positive integer"),     # not the model's default in silence
    (["--height", "0"], "--height 0: expected a positive integer"),
    (["--gpu-memory-gib", "-1"], "argument --gpu-memory-gib: '-1': expected a positive number of GiB"),
    (["--gpu-memory-gib", "0"], "argument --gpu-memory-gib: '0': expected a positive number of GiB"),
    (["--plot", "x.png"], "--plot x.png: only --sweep draws a plot"),
])
def test_bad_sizes_are_refused_before_the_dry_run(argv: list[str], expected: str, no_dry_run: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(["--model", "tiny-wan", *argv], capsys)
    assert code == 2 and expected in err and not out, (code, out, err)


@pytest.mark.parametrize(("drop", "expected"), [
    ("vae", "missing or malformed 'vae' (the VAE's compression"),
    ("vae.causal", "missing vae.causal"),
    ("geometry.frames", "missing geometry.frames"),
])
def test_a_model_file_missing_a_key_names_it(tmp_path: Path, drop: str, expected: str, no_dry_run: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import resources

    data = json.loads(resources.files("dsp_plugin.dryrun").joinpath("configs", "tiny-wan.json").read_text())
    key, _, field = drop.partition(".")
    del (data[key] if field else data)[field or key]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    code, _, err = _main(["--model", str(path)], capsys)
    assert code == 2 and f"--model {path}: {expected}" in err, err
    path.write_text("{not json")
    code, _, err = _main(["--model", str(path)], capsys)
    assert code == 2 and f"--model {path}: not valid JSON" in err, err


@pytest.mark.parametrize(("plot", "expected"), [
    ("/proc/sweep.png", "--plot '/proc' cannot be written"),      # a directory no one can write, even root
    ("sweep.txt", "--plot sweep.txt: matplotlib cannot write .txt files; expected a file ending in one of"),
])
def test_the_sweep_plot_path_is_checked_before_the_sweep(plot: str, expected: str, no_dry_run: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, out, err = _main(["--model", "tiny-wan", "--sweep", "dsp=1,2", "--plot", plot], capsys)
    assert code == 2 and expected in err and not out, (code, out, err)
