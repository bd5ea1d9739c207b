"""The console scripts' manners: ``--version``, a missing extra named in one line, the DeepSpeed example config
shipped in the package, the knob names of the shell launches (old names warn), and arguments a bench would fail
on minutes later refused at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsp_plugin import __version__
from dsp_plugin.launch.cli import SCRIPTS

ROOT = Path(__file__).resolve().parents[1]

# run a console script's entry point with some top-level modules made unimportable (an extra not installed)
_BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Block())
sys.argv = [{prog!r}, *{args!r}]
from dsp_plugin.launch import cli
getattr(cli, {function!r})()
"""


def _script(prog: str, *args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    function = {"dsp-train": "train", "dsp-sample": "sample", "dsp-sample-latte": "sample_latte",
                "dsp-train-deepspeed": "train_deepspeed", "dsp-pretrain-stdit": "pretrain_stdit",
                "dsp-bench": "bench", "dsp-dryrun": "dryrun"}[prog]
    code = _BLOCKED.format(blocked=set(blocked), prog=prog, args=list(args), function=function)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_pyproject_scripts_go_through_cli() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for prog in SCRIPTS:
        assert f'{prog} = "dsp_plugin.launch.cli:' in text, prog


@pytest.mark.parametrize("prog", sorted(SCRIPTS))
def test_version_without_the_extra(prog: str) -> None:
    done = _script(prog, "--version", blocked=("megatron", "deepspeed", "diffusers"))
    assert done.returncode == 0 and done.stdout.strip() == f"{prog} (dsp_plugin) {__version__}", done


@pytest.mark.parametrize(("prog", "blocked", "module", "extra"), [
    ("dsp-pretrain-stdit", ("megatron",), "megatron.core", "megatron"),
    ("dsp-train-deepspeed", ("deepspeed",), "deepspeed", "deepspeed"),
    ("dsp-sample", ("diffusers",), "diffusers", "diffusers"),
])
def test_missing_extra_is_one_line(prog: str, blocked: tuple[str, ...], module: str, extra: str) -> None:
    done = _script(prog, "--help", blocked=blocked)
    assert done.returncode == 2, done
    assert done.stderr == (f"{prog}: error: {module} is not installed; install the extra: "
                           f"pip install 'dsp_plugin[{extra}]'\n"), done.stderr


def test_deepspeed_example_config_ships_in_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    from dsp_plugin.launch import train_deepspeed

    monkeypatch.setattr(sys, "argv", ["dsp-train-deepspeed"])
    path = Path(train_deepspeed.parse_args().deepspeed_config)
    assert path.parent == ROOT / "dsp_plugin" / "launch", path       # inside the package, not launch/
    assert json.loads(path.read_text())["sequence_parallel_mode"] == "dsp"
    assert (ROOT / "launch" / "ds_config_dsp.json").resolve() == path.resolve()   # launch/ names the same file
    assert "ds_config_dsp.json" in (ROOT / "pyproject.toml").read_text()


def test_old_knob_names_warn_and_still_work() -> None:
    """``STEPS`` and ``PORT`` reach ``--steps`` and ``--master_port`` under their new names, with a warning."""
    env = dict(os.environ, STEPS="3", PORT="29999", LAUNCHER="none", PATH=f"{Path(sys.executable).parent}:"
               f"{os.environ['PATH']}")
    done = subprocess.run(["bash", "launch/run_deepspeed.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert "run_deepspeed.sh: STEPS is deprecated; use ITERS=3" in done.stderr, done.stderr
    assert "run_deepspeed.sh: PORT is deprecated; use MASTER_PORT=29999" in done.stderr, done.stderr
    assert "LAUNCHER must be deepspeed or torchrun, got 'none'" in done.stderr and done.returncode == 2
    make = subprocess.run(["make", "-n", "-o", ".venv/.installed", "STEPS=3", "train"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert "STEPS is deprecated; use ITERS=3" in make.stderr and "--steps 3 " in make.stdout, make


def test_memory_bench_refuses_empty_shards_up_front(capsys: pytest.CaptureFixture) -> None:
    from dsp_plugin.bench import memory

    with pytest.raises(SystemExit) as exc:
        memory.main(["--frames", "2"])                  # --nproc 1 2 4: a rank of 4 would hold no frame
    assert exc.value.code == 2
    assert ("--frames 2 and --size 32 (256 patches a frame) leave a rank of --nproc 4 with no frame or patch; "
            "expected --frames >= 4" in capsys.readouterr().err)


def test_old_flag_spellings_are_aliases_that_warn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One flag style (hyphens) across our scripts; dsp-train-deepspeed's underscore flags still parse, and warn."""
    pytest.importorskip("deepspeed")
    from dsp_plugin.launch import cli, train_deepspeed

    argv = ["--save_dir", str(tmp_path), "--losses-json", "l.json", "--load_dir=x"]
    monkeypatch.setattr(sys, "argv", ["dsp-train-deepspeed", *argv])
    args = train_deepspeed.parse_args()
    assert (args.save_dir, args.losses_json, args.load_dir) == (str(tmp_path), "l.json", "x")
    said = cli.warn_renamed("dsp_plugin.launch.train_deepspeed", argv, train_deepspeed.RENAMED)
    assert said == ["dsp_plugin.launch.train_deepspeed: --save_dir is deprecated; use --save-dir",
                    "dsp_plugin.launch.train_deepspeed: --load_dir is deprecated; use --load-dir"], said


def test_quiet_third_party_keeps_their_notices_out_and_ours_in() -> None:
    code = r"""
import logging, warnings
from dsp_plugin.log import quiet_third_party
quiet_third_party()
with warnings.catch_warnings(record=True) as seen:
    warnings.warn_explicit("theirs", FutureWarning, "c10d_logger.py", 1, module="torch.distributed.c10d_logger")
    warnings.warn_explicit("ours", FutureWarning, "x.py", 1, module="dsp_plugin.x")
print([str(w.message) for w in seen], logging.getLogger("diffusers").getEffectiveLevel() == logging.ERROR)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.stdout.strip() == "['ours'] True", done.stdout + done.stderr


def test_logger_rank_zero_filter() -> None:
    """The dsp_plugin logger prints on rank 0; other ranks only records marked all_ranks (those prefixed)."""
    code = r"""
import logging, os, sys
from dsp_plugin.log import get_logger, setup
setup(stream="stdout")
log = get_logger("t")
log.info("said by %s", os.environ["RANK"])
log.warning("every rank", extra={"all_ranks": True})
"""
    outs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r))).stdout for r in (0, 1)]
    assert outs == ["said by 0\n[rank 0] every rank\n", "[rank 1] every rank\n"], outs


def _returns_per_rank_results() -> list[dict[str, int]]:
    return [{"rank": 0}, {"rank": 1}]


def test_a_console_script_exits_0_when_its_main_returns_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The console-script wrapper calls sys.exit(cli.<script>()): a list there printed itself and exited 1."""
    from dsp_plugin.launch import cli

    monkeypatch.setitem(cli.SCRIPTS, "dsp-sample", ("tests.test_cli:_returns_per_rank_results",
                                                    *cli.SCRIPTS["dsp-sample"][1:]))
    monkeypatch.setattr(sys, "argv", ["dsp-sample"])
    monkeypatch.setattr(cli, "require_extra", lambda prog: None)
    with pytest.raises(SystemExit) as exited:
        sys.exit(cli.sample())
    assert exited.value.code is None
