"""The ``diffusers`` extra installs what its code imports: in a site made of only the distributions a fresh
``pip install '.[diffusers]'`` would bring (the extra's requirements, the core's, and theirs, linked from this
venv into a temporary directory; the interpreter started without its own site-packages), a saved tiny
``WanTransformer3DModel`` loads with ``from_pretrained`` and ``export_to_video`` writes an mp4 (dsp-sample's
``--output .mp4``). The extra's list is read from the built wheel, so dropping ``imageio-ffmpeg`` (or
``imageio``) from pyproject.toml fails this test.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.test_install import _metadata, closure, wheel  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parent.parent

_CHECK = r"""
import sys, tempfile
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import numpy as np
from diffusers import WanTransformer3DModel
from diffusers.utils import export_to_video
from dsp_plugin.testing.tiny import tiny_wan
with tempfile.TemporaryDirectory() as tmp:
    model = tiny_wan(layers=1)
    model.save_pretrained(tmp)
    loaded = WanTransformer3DModel.from_pretrained(tmp)
    assert all(bool((a == b).all()) for a, b in zip(model.parameters(), loaded.parameters()))
    export_to_video(list(np.random.rand(3, 16, 16, 3)), f"{tmp}/v.mp4", fps=8)
    import os
    assert os.path.getsize(f"{tmp}/v.mp4") > 0
print("diffusers extra ok")
"""


def _site(dists: set[str], where: Path) -> Path:
    """``where/site``: links to every top-level file and folder of ``dists`` (code and .dist-info)."""
    site = where / "site"
    site.mkdir()
    for dist in md.distributions():
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name not in dists or name == "dsp-plugin":
            continue
        for file in dist.files or []:
            top = file.parts[0]
            if top == ".." or (site / top).exists():
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (site / top).symlink_to(source)
    return site


@pytest.mark.slow
def test_diffusers_extra_runs_from_pretrained_and_writes_mp4(wheel: Path, tmp_path: Path) -> None:  # noqa: F811
    meta = _metadata(wheel)
    extra = [Requirement(r).name for r in meta.get_all("Requires-Dist")
             if 'extra == "diffusers"' in r]
    core = [Requirement(r).name for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert {"accelerate", "imageio", "imageio-ffmpeg"} <= set(extra), extra
    site = _site(closure(core + extra), tmp_path)
    done = subprocess.run([sys.executable, "-S", "-c", _CHECK, str(site), str(ROOT)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "diffusers extra ok" in done.stdout, done.stderr[-3000:]
