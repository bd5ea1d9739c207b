"""Every runnable line of README.md and docs/*.md, run (at sizes a test affords) or checked, with the reason.

What counts as runnable: every line of a ```bash block (backslash continuations and
multi-line quotes joined), every ```python and ```json block, and inline `code` that starts
like a command (``python``, ``.venv/bin/``, ``torchrun``, ``make``, ``pytest``, ``KNOB=value``,
``./launch/``, ``deepspeed``, ``pip``, ``sbatch``). Blocks without a language are output.

Each item meets the first rule of ``RULES`` whose pattern matches it. A rule says what is done:

- ``run``: executed from the repository root (``subs`` shrink sizes and move outputs to a
  temporary folder); the exit status must be 0 and ``expect`` must appear in the output;
- ``check``: the line is not run, but every ``KNOB=`` it sets must be read by the script it
  launches, every ``--flag`` must be in that script's ``--help``, and shell lines must parse
  (``bash -n``); ``why`` names what runs the same configuration, or why it cannot run here;
- ``covered``: run by the named test (which must exist), too slow to run twice;
- ``skip``: cannot run here (GPU, several nodes, installs), with the reason.

A line no rule matches fails the test, naming the doc and line: new docs lines get a rule.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(\.venv/bin/|python |torchrun |make |pytest |[A-Z][A-Z0-9_]*=\S* |\./launch/|deepspeed |"
                     r"pip |sbatch |bash )")


@dataclass
class Item:
    doc: str
    line: int
    kind: str          # "bash", "python", "json", "inline"
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _shell_commands(block: str, first_line: int) -> list[tuple[int, str]]:
    """Logical commands of a bash block: continuations and open quotes joined, comments dropped."""
    out, buf, start = [], "", 0
    for i, raw in enumerate(block.splitlines()):
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if not buf:
            start = first_line + i
        buf += raw + "\n"
        if buf.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(buf, comments=True)
        except ValueError:      # an open quote: the command goes on
            continue
        out.append((start, buf.strip()))
        buf = ""
    return out


def extract(doc: str) -> list[Item]:
    text = (ROOT / doc).read_text()
    items: list[Item] = []
    fenced = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M))
    for m in fenced:
        lang, body, line = m.group(1), m.group(2), text[:m.start()].count("\n") + 2
        if lang in ("bash", "sh"):
            items += [Item(doc, n, "bash", cmd) for n, cmd in _shell_commands(body, line)]
        elif lang in ("python", "json"):
            items.append(Item(doc, line, lang, body))
    spans = [(m.start(), m.end()) for m in fenced]
    for m in re.finditer(r"`([^`\n]+)`", text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        code = m.group(1).strip()
        if COMMAND.match(code + " ") and not code.endswith("="):
            items.append(Item(doc, text[:m.start()].count("\n") + 1, "inline", code))
    return items


ALL = [item for doc in DOCS for item in extract(doc)]


@dataclass(frozen=True)
class Rule:
    pattern: str                   # re.search on "<doc>:<kind>:<text>"
    action: str                    # run | check | covered | skip
    why: str = ""
    subs: tuple[tuple[str, str], ...] = ()
    expect: str = ""
    timeout: int = 300
    prelude: str = ""              # python: code run before the block
    tests: tuple[str, ...] = field(default=())   # covered: "tests/file.py::name"


TINY_MEGATRON = (("ITERS=6", "ITERS=2"), ("^", "ITERS=2 "))
RULES: list[Rule] = [
    # ---- recursion, installs, GPU, several nodes -------------------------------------------------------------
    Rule(r":make test", "skip", "the test suite itself"),
    Rule(r"^README\.md:bash:source \.venv/bin/activate", "run"),
    Rule(r"^README\.md:inline:make( setup)?$", "check", "the setup make train and make test start with (run below)"),
    Rule(r":inline:.*<\w+>", "skip", "a pattern with a placeholder (<name>), not a command"),
    Rule(r":pip install", "skip", "installs into the environment; tests/test_install.py checks the package"),
    Rule(r"IMPL=transformer_engine|FP8=", "check", "needs a GPU with Transformer Engine"),
    Rule(r"NNODES=2|--nnodes 2|HOSTFILE=|sbatch ", "check", "needs several nodes"),
    Rule(r":inline:([A-Z][A-Z0-9_]*=\S*\s*)+$", "check", "a knob named in prose: some source file must read it"),
    Rule(r"python -m dsp_plugin\.bench --nproc [24](\s*#.*)?$|:inline:python -m dsp_plugin\.bench$", "check",
         "the full-size bench takes 10+ minutes; --quick runs the same code (tests/test_bench.py)"),
    # ---- the main job --------------------------------------------------------------------------------------------
    Rule(r":DSP_CHECK=1 make train", "check", "tests/test_cross_rank.py runs every DSP_CHECK mode; make train "
         "itself runs below"),
    Rule(r":inline:torchrun --nproc-per-node 4 -m dsp_plugin\.launch\.train_dsp$", "check",
         "what make train runs (below), with 4 processes"),
    Rule(r":(NPROC=2 ITERS=20 )?make train", "run", "",
         ((r"^(NPROC=2 ITERS=20 )?make train.*", "make -o .venv/.installed NPROC=2 ITERS=2 train"),),
         expect="largest difference: 0.00e+00"),
    Rule(r"python -m dsp_plugin\.launch\.train_dsp --help", "run", expect="--frames"),
    # ---- Megatron --------------------------------------------------------------------------------------------
    Rule(r"^README\.md:bash:NPROC=2 DSP=2 EVAL_ITERS=2 EVAL_INTERVAL=2 \./launch/run_megatron\.sh", "covered",
         tests=("tests/test_megatron_launch.py::test_evaluation_prints_megatron_validation_loss",)),
    Rule(r"run_megatron\.sh", "check", "tests/test_megatron_launch.py runs the launch (DSP=2, eval, resume); "
         "tests/test_megatron_parallel.py the TP/PP/DP layouts and recompute"),
    Rule(r":python:.*parse_and_validate_args", "skip", "a fragment: Megatron's required arguments come from the "
         "command line, as dsp_plugin/launch/pretrain_stdit.py takes them (its --help runs here)"),
    Rule(r":python:.*TransformerBlock\(config, dsp_layer_spec", "covered",
         tests=("tests/test_megatron_example.py::test_documented_own_model_example_dsp2_equals_dsp1",)),
    Rule(r"pytest tests/test_megatron", "covered", tests=("tests/test_megatron_parallel.py",
                                                          "tests/test_megatron_example.py",
                                                          "tests/test_megatron_precision.py")),
    # ---- DeepSpeed -------------------------------------------------------------------------------------------
    Rule(r"^README\.md:bash:NPROC=2 DSP=2 ZERO=3 PRECISION=bf16 \./launch/run_deepspeed\.sh", "covered",
         tests=("tests/test_deepspeed_launch.py::test_bf16_zero3_through_run_deepspeed_sh",)),
    Rule(r"run_deepspeed\.sh --help", "run", expect="HOSTFILE"),
    Rule(r"run_deepspeed\.sh|deepspeed --num_gpus|launch[/.]train_deepspeed", "check",
         "tests/test_deepspeed_launch.py runs both launchers and bf16 ZeRO-3 through run_deepspeed.sh"),
    Rule(r"docs/deepspeed\.md:python", "skip", "a fragment of dsp_plugin/launch/train_deepspeed.py (the lines DSP "
         "changes); the whole script runs in tests/test_deepspeed_launch.py"),
    Rule(r"python -m tests\.test_deepspeed_(convention|gradients)|pytest tests/test_deepspeed", "covered",
         tests=("tests/test_deepspeed_convention.py", "tests/test_deepspeed_gradients.py")),
    Rule(r"docs/deepspeed\.md:json", "run"),
    Rule(r"examples/train_wan_deepspeed\.py", "covered", tests=("tests/test_example_wan_deepspeed.py",)),
    # ---- FSDP2 ---------------------------------------------------------------------------------------------------
    Rule(r"examples/train_wan_fsdp2\.py --dsp 2 --steps 3 --compile$", "check",
         "inductor builds C++ on every rank (the first step took 62.5 s on a shared 2-core CPU); "
         "tests/test_example_wan_fsdp2.py runs --compile with the aot_eager backend"),
    Rule(r"examples/train_wan_fsdp2\.py", "covered", tests=("tests/test_example_wan_fsdp2.py",)),
    Rule(r"docs/fsdp\.md:python:import torch\nfrom torch\.distributed\.device_mesh", "covered",
         tests=("tests/test_fsdp.py",), why="the order of wrapping, as tests/test_fsdp.py's _Job applies it"),
    Rule(r"examples/evoformer_dap\.py", "covered", tests=("tests/test_evoformer_dap.py",)),
    # ---- sampling --------------------------------------------------------------------------------------------
    Rule(r"^README\.md:bash:\.venv/bin/torchrun --nproc-per-node 2 -m dsp_plugin\.launch\.sample_latte",
         "run",
         subs=(("out/video.pt", "{tmp}/video.pt"), ("--out", "--frames 3 --steps 1 --layers 1 --out")),
         expect="wrote"),
    Rule(r"dsp_plugin\.launch\.sample_latte", "check",
         "tests/test_sampling_launch.py runs these on 1, 2 and 4 processes"),
    Rule(r"python -m dsp_plugin\.testing\.tiny_pipelines \S+ /tmp/tiny-", "covered",
         tests=("tests/test_sample_video_pipelines.py::test_model_directories_sample_on_two_ranks_equal_diffusers",),
         why="that test writes each tiny pipeline through the same save_case and samples it as the next line does"),
    Rule(r"dsp_plugin\.launch\.sample\b|dsp-sample\b", "check",
         "tests/test_sample_command.py runs torchrun on 2 processes (with and without --cfg-parallel, and with "
         "--vae-tiling) and --dsp 2"),
    Rule(r"docs/(models|inference)\.md:python", "covered",
         tests=("tests/test_adapters_docs.py::test_python_blocks_run",)),
    Rule(r"pytest -s tests/test_sampling_latte\.py", "covered", tests=("tests/test_sampling_latte.py",)),
    Rule(r"python -m dsp_plugin\.bench\.latency", "covered",
         tests=("tests/test_docs_commands.py::test_latency_command_writes_its_table_and_plot",)),
    # ---- benches ---------------------------------------------------------------------------------------------
    Rule(r"bench --scale-only --calibration measured\.json", "run", subs=(("measured.json", "{calibration}"),),
         expect="MEASURED (H100 run"),
    Rule(r"bench --scale-only", "run", expect="Fig 8"),
    Rule(r"bench --costs\b", "check", "flags checked; tests/test_bench_costs.py runs the same costs section at tiny "
         "sizes and the compiled runtime's count apart (a first compiled call takes about a minute here); "
         "--device cuda:0 needs a GPU (tests/test_bench_hand_wan.py runs the A/B in a fake world and on gloo)"),
    Rule(r"python -m dsp_plugin\.bench\.mixed", "covered",
         tests=("tests/test_bench_mixed.py::test_measured_equals_the_formula_and_outputs_match",)),
    Rule(r"bench --quick", "covered", tests=("tests/test_bench.py::test_quick_bench_runs_and_writes_its_files",)),
    Rule(r"bench --methods", "check", "flags checked; the methods run in tests/test_bench.py"),
    Rule(r"bench --wan-only|bench --no-wan", "check", "flags checked; the same full-3D section runs in "
         "tests/test_bench.py (--quick) and its Wan row in tests/test_plan_bench.py"),
    Rule(r"python -m dsp_plugin\.bench\.wan", "covered",
         tests=("tests/test_plan_bench.py::test_wan_row_quick_runs_diffusers_beside_ours",)),
    Rule(r"python -m dsp_plugin\.bench\.cp_plan_models", "covered",
         tests=("tests/test_bench_cp_plan_models.py::test_cp_plan_models_bench_at_two_ranks",)),
    Rule(r"docs/benchmarks\.md:json", "run"),
    Rule(r"dsp_plugin\.bench\.switch --reps 30 --compare-with", "run",
         subs=((r"--reps 30 --compare-with OLD_COMM\.py", "--nproc 2 --mib 1 --reps 2 --compare-with "
                "dsp_plugin/comm/primitives.py"),), expect="old switch"),
    Rule(r"python -m dsp_plugin\.bench\.switch$", "check", "the same module runs on the line above "
         "(docs/benchmarks.md)"),
    Rule(r"dsp_plugin\.bench\.memory", "run", subs=(("$", " --nproc 2 --frames 2 --size 8"),),
         expect="ideal 1/N"),
    Rule(r"dsp_plugin\.dryrun --model wan2\.1-14b --frames 81 --height 720 --width 1280 --dsp 8 --zero 3 "
         r"--recompute full$", "run", expect="fits", timeout=600),
    Rule(r"dsp_plugin\.dryrun", "check", "the line above runs the 14B dry run; tests/test_dryrun.py runs the "
         "same code on tiny configs against real gloo steps (a 14B sweep takes minutes)"),
    Rule(r"dsp_plugin\.check( --model tiny-latte|$)", "covered",
         tests=("tests/test_plan_check.py::test_good_plan_exits_zero",
                "tests/test_plan_check.py::test_wrong_axis_plan_exits_nonzero_naming_the_module")),
    Rule(r"dsp_plugin\.check --model dsp_plugin\.testing\.tiny_video_more:cosmos", "covered",
         tests=("tests/test_plan_check.py::test_cosmos_and_kandinsky5_are_checked_in_their_own_dtypes",
                "tests/test_plan_check.py::test_json_report"),
         why="the same check through the checker's own functions on the test ranks; --json through main()"),
    Rule(r"dsp_plugin\.bench\.published", "run", expect="Wan 2.1 14B"),
    # ---- core, data, accounting -------------------------------------------------------------------------------
    Rule(r"^README\.md:python:from dsp_plugin import", "run", prelude=(
        "import torch\nx = torch.randn(2, 4, 6, 8)\n"
        "dataloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=1)\n")),
    Rule(r":python:from dsp_plugin import dsp_dataloader, split, gather, dynamic_switch\s*$", "run"),
    Rule(r"docs/data_and_accounting\.md:python:.*def step\(rank", "run", expect="all_to_all"),
    Rule(r"\.venv/bin/python acct_ddp\.py", "covered", tests=("tests/test_docs.py::test_doc_line",),
         why="the python block above it, saved as acct_ddp.py, runs here"),
    Rule(r"\.venv/bin/python -c|python -c", "run"),
    Rule(r"pytest tests/test_|pytest -s tests/test_", "covered", tests=()),
    Rule(r"docs/api\.md:python:import torch\.distributed as dist\nfrom dsp_plugin import Topology", "covered",
         tests=("tests/test_reliability.py",), why="a fragment needing torchrun's environment; Topology.world() "
         "under a real gloo world runs in the tests named"),
    Rule(r"docs/concepts\.md:python:x = dsp_plugin\.replicate_grad", "covered",
         tests=("tests/test_input_gradients.py::test_input_gradient_conventions",),
         why="a fragment (a parallelized model and its batch); the test makes the same calls on two ranks against "
         "one process"),
    Rule(r"docs/api\.md:python:import torch\nimport torch\.nn\.functional as F", "covered",
         tests=("tests/test_heads.py::test_the_api_example_runs_on_two_ranks",)),
    Rule(r"PYTHONPATH=\. python scripts/check_cost\.py", "run", expect="us per call"),
    Rule(r"docs/megatron\.md:bash:F=\"--position-embedding-type rope", "covered",
         tests=("tests/test_megatron_paper_model.py",), why="the flags the two run_megatron.sh lines below take"),
    # ---- the GPU path --------------------------------------------------------------------------------------
    Rule(r"scripts/gpu_check\.sh --dry-run", "run", expect="sampling"),
    Rule(r"scripts/gpu_check\.sh( attention sampling)?\s*(#.*)?$", "covered",
         tests=("tests/test_gpu_check.py",), why="needs a GPU; the dry run, a SKIP without CUDA and the attention "
         "step's CPU form run there"),
    Rule(r"scripts/gpu_check/wheels\.sh", "skip", "downloads wheels from the package index"),
    Rule(r"docs/gpu\.md:inline:pytest -m gpu$", "skip", "the GPU tests: they skip without CUDA"),
    Rule(r"docs/troubleshooting\.md:bash:torchrun .*-m dsp_plugin\.launch\.train_dsp .*--timeout", "check",
         "a frozen peer needs a second terminal; tests/test_reliability_launch.py bounds the launches' exits"),
    Rule(r"docs/troubleshooting\.md:inline:(torchrun|deepspeed) --(standalone|master_port)", "skip",
         "a launcher option named in prose, not a command"),
]


def rule_for(item: Item) -> Rule | None:
    key = f"{item.doc}:{item.kind}:{item.text}"
    return next((r for r in RULES if re.search(r.pattern, key, flags=re.S)), None)


def _env() -> dict[str, str]:
    """A shell after ``source .venv/bin/activate`` (the README's quick start), the venv that runs these tests:
    its bin first on PATH and nothing else, so a line runs as written (no PYTHONPATH a user would not have)."""
    venv = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "VIRTUAL_ENV": str(venv.parent), "OMP_NUM_THREADS": "1",
            "PATH": f"{venv}:" + os.environ.get("PATH", "")}


@functools.cache
def _help(script: str) -> str:
    """``--help`` of a launched script, whose flags the doc lines may use."""
    out = subprocess.run([sys.executable, "-m", script, "--help"], capture_output=True, text=True, cwd=ROOT,
                         env=_env(), timeout=180)
    assert out.returncode == 0, f"{script} --help failed: {out.stderr[-2000:]}"
    return out.stdout


_LAUNCHED = {"run_megatron.sh": "dsp_plugin.launch.pretrain_stdit",
             "run_deepspeed.sh": "dsp_plugin.launch.train_deepspeed",
             **{f"dsp_plugin.launch.{n}": f"dsp_plugin.launch.{n}"
                for n in ("train_deepspeed", "sample_latte", "sample", "train_dsp", "pretrain_stdit")},
             "dsp-sample": "dsp_plugin.launch.sample"}
_ENV_READERS = {"DSP_CHECK": "dsp_plugin/checks.py", "DSP_BACKEND": "dsp_plugin/backend.py"}


def check_line(item: Item) -> None:
    """Knobs read by the script, flags in its --help, shell syntax."""
    text = item.text
    syntax = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{item.where}: shell syntax: {syntax.stderr}"
    words = shlex.split(text, comments=True)
    if all(re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", w) for w in words):     # knobs named in prose
        sources = [p for d in ("dsp_plugin", "launch", "scripts") for p in (ROOT / d).rglob("*") if p.is_file()
                   and p.suffix in (".py", ".sh", ".sbatch")] + [ROOT / "Makefile"]
        for knob in (w.split("=")[0] for w in words):
            assert any(re.search(rf"\b{knob}\b", p.read_text()) for p in sources), f"{item.where}: nothing reads {knob}"
        return
    shell_script = next((w for w in words if w.endswith(".sh")), None)
    for word in words:
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", word):
            break
        knob = word.split("=")[0]
        source = _ENV_READERS.get(knob) or shell_script or "Makefile"
        assert re.search(rf"\b{knob}\b", (ROOT / source).read_text()), f"{item.where}: {knob} is not read by {source}"
    target = next((_LAUNCHED[k] for k in _LAUNCHED if any(w.endswith(k) for w in words)), None)
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    if shell_script is None:  # the launcher's own flags come before the script
        names = [w for w in words if any(w.endswith(k) for k in _LAUNCHED)]
        flags = [w.split("=")[0] for w in words[words.index(names[0]):] if w.startswith("--")] if names else []
    if "dsp_plugin.bench" in words:
        from dsp_plugin.bench.__main__ import parse_args

        parse_args(words[words.index("dsp_plugin.bench") + 1:])
        return
    if "dsp_plugin.bench.switch" in words:
        target = "dsp_plugin.bench.switch"
    if target and flags:
        help_text = _help(target)
        missing = [f for f in flags if f not in help_text]
        assert not missing, f"{item.where}: {missing} not in {target} --help"


def run_item(item: Item, rule: Rule, tmp: Path) -> str:
    if item.kind == "json":
        data = json.loads(item.text)
        if "layer_tflops" in data:      # the calibration example: load it the way the bench does
            (tmp / "calibration.json").write_text(item.text)
            from dsp_plugin.bench import calibration

            calibration.load(tmp / "calibration.json")
        return ""
    if item.kind == "python":
        script = tmp / "block.py"
        script.write_text(rule.prelude + item.text)
        argv = [sys.executable, str(script)]
    else:
        text = re.sub(r"\s+#[^'\"\n]*$", "", item.text)       # a trailing comment, so substitutions can append
        for old, new in rule.subs:
            text = re.sub(old, new.replace("{tmp}", str(tmp)).replace("{calibration}", str(tmp / "measured.json")),
                          text, count=1)
        if "{calibration}" in "".join(n for _, n in rule.subs):
            (tmp / "measured.json").write_text(_calibration_example())
        argv = ["bash", "-c", text]
    key = " ".join(argv) if item.kind != "python" else rule.prelude + item.text
    if key in _DONE:           # the same command on another line (README and docs repeat some)
        return _DONE[key]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=rule.timeout)
    output = out.stdout + out.stderr
    assert out.returncode == 0, f"{item.where}: exit {out.returncode}\n{argv}\n{output[-4000:]}"
    assert rule.expect in output, f"{item.where}: {rule.expect!r} not in the output\n{output[-3000:]}"
    _DONE[key] = output
    return output


_DONE: dict[str, str] = {}


def _calibration_example() -> str:
    blocks = [i for i in ALL if i.kind == "json" and "layer_tflops" in i.text]
    assert blocks, "docs/benchmarks.md lost its calibration example"
    return blocks[0].text


def test_every_runnable_line_has_a_rule():
    missing = [f"{i.where} [{i.kind}] {i.text.splitlines()[0][:100]}" for i in ALL if rule_for(i) is None]
    assert not missing, "doc lines with no rule in tests/test_docs.py (add one):\n" + "\n".join(missing)
    assert len(ALL) >= 60, len(ALL)


def _covered_exists(spec: str) -> None:
    path, _, name = spec.partition("::")
    assert (ROOT / path).exists(), spec
    if name:
        assert re.search(rf"def {name}\b", (ROOT / path).read_text()), spec


_RUN = [i for i in ALL if (r := rule_for(i)) is not None and r.action in ("run", "check", "covered")]


@pytest.mark.slow
@pytest.mark.parametrize("item", _RUN, ids=[f"{i.where}:{i.kind}" for i in _RUN])
def test_doc_line(item: Item, tmp_path: Path) -> None:
    rule = rule_for(item)
    assert rule is not None
    if rule.action == "covered":
        for spec in rule.tests:
            _covered_exists(spec)
        if not rule.tests:       # a pytest line: its files (and -k names) must exist
            for word in shlex.split(item.text):
                if word.startswith("tests/"):
                    _covered_exists(word)
        return
    if rule.action == "check":
        check_line(item)
        return
    if "def step(rank" in item.text:   # docs/data_and_accounting.md: run as the acct_ddp.py it names
        (tmp_path / "acct_ddp.py").write_text(item.text)
        out = subprocess.run([sys.executable, str(tmp_path / "acct_ddp.py")], capture_output=True, text=True,
                             cwd=ROOT, env=_env(), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "all_to_all" in out.stdout
        return
    run_item(item, rule, tmp_path)
