"""Only modules named ``comm.py`` may call torch.distributed collectives (design.md §5).

A static scan of the package, in the spirit of DeepSpeed's scripts/check-torchdist.py:
any call ``<dist alias>.<collective>(...)`` or ``from torch.distributed import
<collective>`` outside a ``comm.py`` fails the test, naming file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dsp_plugin

COLLECTIVES = {
    "all_to_all", "all_to_all_single", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list",
    "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
}
PACKAGE = Path(dsp_plugin.__file__).parent


def _dist_aliases(tree: ast.AST) -> set[str]:
    """Names bound to torch.distributed (``import torch.distributed as dist``)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" :
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return aliases


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.distributed"):
            found += [f"{path}:{node.lineno} imports {a.name}" for a in node.names if a.name in COLLECTIVES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            base = ast.unparse(node.func.value)
            if base in aliases or base == "torch.distributed":
                found.append(f"{path}:{node.lineno} calls {base}.{node.func.attr}")
    return found


def test_only_comm_modules_call_collectives() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "comm.py"]
    assert len(files) > 5
    violations = [v for p in files for v in _violations(p)]
    assert violations == [], "collectives outside a comm.py module:\n" + "\n".join(violations)


def test_the_scan_catches_a_direct_call(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\n\ndef f(x):\n    dist.all_to_all_single(x, x)\n")
    assert _violations(bad) == [f"{bad}:4 calls dist.all_to_all_single"]
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("from torch.distributed import all_gather\nimport torch\n\ntorch.distributed.barrier()\n")
    assert _violations(sneaky) == [f"{sneaky}:1 imports all_gather", f"{sneaky}:4 calls torch.distributed.barrier"]
