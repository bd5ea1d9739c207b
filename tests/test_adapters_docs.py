"""The runnable lines of docs/models.md and docs/inference.md run as printed.

Python blocks are executed in one process. Shell lines that launch
``dsp_plugin.launch.sample_latte`` are parsed with the script's own argument parser here
(``tests/test_sampling_launch.py`` runs the same launches on 1, 2 and 4 processes).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["docs/models.md", "docs/inference.md"]


def _blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc: str) -> None:
    blocks = _blocks(doc, "python")
    assert blocks, f"{doc} has no python block"
    for code in blocks:
        exec(compile(code, doc, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs


def test_sample_latte_lines_parse() -> None:
    from dsp_plugin.launch import sample_latte

    lines = [line for block in _blocks("docs/inference.md", "bash") for line in block.splitlines()
             if "dsp_plugin.launch.sample_latte" in line]
    assert len(lines) == 4
    for line in lines:
        words = shlex.split(line)
        args = sample_latte.parse_args(words[words.index("dsp_plugin.launch.sample_latte") + 1:])
        assert args.frames == 7


@pytest.mark.parametrize("doc", ["docs/inference.md"])
def test_python_blocks_refuse_under_a_launcher_without_a_process_group(doc: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Started by torchrun (``WORLD_SIZE=2``) with no ``init_process_group``, each sampling example refuses
    (``NoProcessGroupError``) instead of sampling the whole video on every rank (issue 25, item 11)."""
    from dsp_plugin.comm import NoProcessGroupError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    for code in _blocks(doc, "python"):
        with pytest.raises(NoProcessGroupError, match="rank 1 of WORLD_SIZE=2.*init_process_group"):
            exec(compile(code, doc, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs
