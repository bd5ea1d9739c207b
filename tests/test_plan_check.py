"""``python -m dsp_plugin.check``, as a user runs it: a good plan exits 0, a wrong-axis plan exits 1 naming
the first module whose output differs, a bad argument exits 2 before anything is spawned. The first two are
docs/models.md's two lines, run as printed.

The rest call the checker's own functions on the rank pool (``cli._rank`` on every rank, ``report.report``
here), which is what ``main`` does on processes of its own: every tensor of a tuple output compared and named
(a toy block, Wan VACE's control blocks), Cosmos and Kandinsky 5 checked in their own dtypes where float64 fails,
the Gather message, the JSON report, and every argument refused before a rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_distributed

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parent.parent
PLANS = "tests.plan_check_plans"
TINY = "dsp_plugin.testing.tiny_video_more"


def _check(*args: str, module: str = "dsp_plugin.check") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_good_plan_exits_zero() -> None:
    run = _check("--model", "tiny-latte", "--nproc", "2")
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: equal to one process on 2 ranks" in run.stdout
    # every planned module has its row, with the collectives it issued: one switch after each block each way
    rows = {line.split()[0]: line for line in run.stdout.splitlines()[2:] if line and not line.startswith("model")}
    for path in ("pos_embed", "transformer_blocks.0", "temporal_transformer_blocks.1", "norm_out"):
        assert path in rows, run.stdout
    assert "1 all_to_all" in rows["transformer_blocks.0"] and "1 all_gather" in rows["norm_out"], run.stdout


def test_wrong_axis_plan_exits_nonzero_naming_the_module() -> None:
    run = _check("--model", "tiny-latte", "--plan", f"{PLANS}:WRONG_AXIS_LATTE_PLAN", "--nproc", "2")
    print(run.stdout, run.stderr)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIFFERS: temporal_transformer_blocks.0 is the first module whose output differs" in run.stdout


def test_unknown_model_exits_two_naming_it() -> None:
    run = _check("--model", "tiny-nothing", "--nproc", "2", module="dsp_plugin.plan.check")   # the old name too
    assert "dsp_plugin.plan.check is now python -m dsp_plugin.check" in run.stderr, run.stderr
    assert run.returncode == 2, run.stdout + run.stderr
    assert "'tiny-nothing'" in run.stderr and "tiny-hunyuan-video" in run.stderr, run.stderr


def _checks(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> list[Any]:
    """``cli._rank`` for each (model, plan, dtype): its Result, or the error it raised."""
    from dsp_plugin.check.cli import _rank

    out = []
    for model, plan, dtype in cases:
        try:
            out.append(_rank(rank, world_size, model, plan, dtype, 0))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def _verdicts(cases: list[tuple[str, str, str]], rtol: float | None = None) -> list[Any]:
    from dsp_plugin.check.report import derived_rtol, report

    per_rank = run_distributed(_checks, 2, cases, timeout=300)
    verdicts = []
    for i, (model, plan, _) in enumerate(cases):
        results = [r[i] for r in per_rank]
        if isinstance(results[0], str):
            verdicts.append(results[0])
            continue
        tol = rtol if rtol is not None else derived_rtol(results[0].dtype_mode, results[0].dtypes)
        verdict = report(results, tol, 0.0, f"{model} {plan}", 2)
        print("\n".join([*verdict.lines, verdict.line]))
        verdicts.append(verdict)
    return verdicts


def test_every_tensor_of_a_tuple_output_is_compared_and_named() -> None:
    # The toy block returns (projection, its running sum along S). Split on S, the running sum is wrong; the model
    # drops it, so only comparing output[1] tells: the checker used to leave it out and print OK
    good, wrong = _verdicts([(f"{PLANS}:tuple_case", f"{PLANS}:TUPLE_PLAN", "auto"),
                             (f"{PLANS}:tuple_case", f"{PLANS}:WRONG_TUPLE_PLAN", "auto")])
    assert good.status == "OK", good.lines
    assert [e["name"] for e in good.data["modules"][0]["outputs"]] == ["output[0]", "output[1]"]
    assert wrong.status == "DIFFERS", wrong.lines
    assert wrong.line.startswith("DIFFERS: block is the first module whose output differs from one process, at "
                                 "output[1]"), wrong.line
    row = next(line for line in wrong.lines if line.startswith("block "))
    assert row.endswith("DIFFERS at output[1]"), row


def test_wan_vace_control_blocks_compared_element_by_element() -> None:
    # Wan VACE's control blocks return (hint, control stream); left out of the head switch, each rank's control
    # attention sees its own frames: both tensors differ, named, from the first control block on
    good, wrong = _verdicts([(f"{TINY}:wan_vace", f"{PLANS}:WAN_VACE_PLAN", "auto"),
                             (f"{TINY}:wan_vace", f"{PLANS}:WRONG_WAN_VACE_PLAN", "auto")])
    assert good.status == "OK", good.lines
    block = next(m for m in good.data["modules"] if m["path"] == "vace_blocks.0")
    assert [(e["name"], e["note"]) for e in block["outputs"]] == [("output[0]", ""), ("output[1]", "")]
    assert wrong.line.startswith("DIFFERS: vace_blocks.0 is the first module whose output differs from one "
                                 "process, at output[0], output[1]"), wrong.line


def test_cosmos_and_kandinsky5_are_checked_in_their_own_dtypes() -> None:
    # both keep modules in fp32 and fail when cast to float64: checked in their own dtypes, said in one line;
    # asked for float64 explicitly, the run fails with the model's own error
    cosmos, kandinsky, insisted = _verdicts([(f"{TINY}:cosmos", f"{PLANS}:COSMOS_PLAN", "auto"),
                                             (f"{TINY}:kandinsky5", f"{PLANS}:KANDINSKY5_PLAN", "auto"),
                                             (f"{TINY}:cosmos", f"{PLANS}:COSMOS_PLAN", "float64")])
    for verdict, error in ((cosmos, "linalg.vector_norm"), (kandinsky, "mat1 and mat2 must have the same dtype")):
        assert verdict.status == "OK", verdict.lines
        assert verdict.data["checked_in"] == "model" and verdict.data["dtypes"] == ["float32"], verdict.data
        assert verdict.data["dtype_note"].startswith("float64 fails on one process (RuntimeError: " + error)
        assert abs(verdict.data["rtol"] - 3.45e-4) < 1e-6  # sqrt of fp32's epsilon
    assert insisted.startswith("RuntimeError: linalg.vector_norm"), insisted


def _gather_untagged(rank: int, world_size: int) -> str:
    import torch

    import dsp_plugin
    from tests.plan_check_plans import GATHER_UNTAGGED_PLAN, GatherFirst

    torch.manual_seed(0)
    model = dsp_plugin.parallelize(GatherFirst(), GATHER_UNTAGGED_PLAN)
    with pytest.raises(ValueError) as error:
        model(torch.randn(2, 5, 4))
    return str(error.value)


def test_gather_on_an_untagged_tensor_names_the_placement_the_forward_holds() -> None:
    # met while the forward runs, before any Split: it used to say "no forward of this model is in progress"
    for message in run_distributed(_gather_untagged, 2):
        assert message.startswith("side: Gather(0): this tensor of shape (2, 5, 4) has no shard tag, and the "
                                  "forward holds R (replicated"), message
        assert "no forward of this model is in progress" not in message, message


@pytest.mark.parametrize(("argv", "expected"), [
    (["--rtol", "-1"], "--rtol -1: expected a finite tolerance >= 0"),
    (["--atol", "nan"], "--atol nan: expected a finite tolerance >= 0"),
    (["--nproc", "0"], "--nproc 0: expected at least 1 rank"),
    (["--plan", "os.path:join"], "--plan 'os.path:join': calling it with the model (TupleModel) raised TypeError"),
    (["--plan", f"{PLANS}:TupleModel"], f"--plan '{PLANS}:TupleModel' is a type; expected a plan"),
    (["--plan", f"{PLANS}:TOKENS"], f"--plan '{PLANS}:TOKENS' is a str; expected a plan"),
    (["--plan", "dsp_plugin.check.cli:DTYPES"], "entry 'float64': torch.float64; expected a module path"),
    (["--model", f"{PLANS}:TOKENS"], f"--model '{PLANS}:TOKENS' is a str; expected a function"),
    (["--json", "/nonexistent/report.json"], ("--json '/nonexistent/report.json': expected a file path in a "
                                              "writable directory")),
])
def test_bad_argument_exits_two_before_any_rank(argv: list[str], expected: str, capsys: Any,
                                                monkeypatch: Any) -> None:
    from dsp_plugin.check import cli as check

    monkeypatch.setattr(check, "run_check", lambda *a, **k: pytest.fail("a rank was started"))
    argv = ["--model", f"{PLANS}:tuple_case", *argv] if "--model" not in argv else argv
    assert check.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dsp_plugin.check: error: ") and expected in err, err
    assert len(err.splitlines()) == 1, err


def test_json_report(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    # main() end to end, its ranks on the pool instead of processes of its own
    from dsp_plugin.check import cli as check

    monkeypatch.setattr(check, "run_check", lambda model, plan, nproc, dtype, seed: run_distributed(
        check._rank, nproc, model, plan, dtype, seed))
    path = tmp_path / "report.json"
    code = check.main(["--model", f"{PLANS}:tuple_case", "--plan", f"{PLANS}:WRONG_TUPLE_PLAN", "--json", str(path)])
    assert code == 1
    data = json.loads(path.read_text())
    assert data["status"] == "DIFFERS" and data["verdict"].startswith("DIFFERS: block"), data
    assert data["checked_in"] == "float64" and data["rtol"] == 1e-6 and data["nproc"] == 2, data
    block = data["modules"][0]
    assert block["path"] == "block" and block["differs"] and block["forward"] == "-", block
    assert [(e["name"], e["differs"]) for e in block["outputs"]] == [("output[0]", False), ("output[1]", True)]
    assert "DIFFERS at output[1]" in capsys.readouterr().out  # the table is printed too


def test_a_tensor_not_compared_is_not_ok() -> None:
    # an output tensor the checker could not place against one process: the verdict names it, never OK
    from dsp_plugin.check.report import report
    from dsp_plugin.check.compare import Element, ModuleResult, Result

    placed = Element("output[0]", out_diff=0.0, out_scale=1.0)
    lost = Element("output[1]", out_scale=1.0, note="shape (2, 3) is not placed against (2, 5): not compared")
    results = [Result([ModuleResult("block", "Block", calls=1, elements=[placed, lost], finished=0)])] * 2
    verdict = report(results, 1e-6, 0.0, "title", 2)
    assert verdict.status == "NOT CHECKED", verdict.lines
    assert verdict.line.startswith("NOT CHECKED: block output[1] (shape (2, 3) is not placed"), verdict.line
    assert verdict.lines[-1].startswith("model:") and "NOT CHECKED" in verdict.lines[2], verdict.lines
