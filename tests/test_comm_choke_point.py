"""Only the communication modules may call torch.distributed collectives (design.md §5).

Those are ``comm/collectives.py`` (the one module of the ``dsp_plugin.comm`` package that
calls them) and the baselines' and the DeepSpeed guard's own ``comm.py``.
A static scan of the package, in the spirit of DeepSpeed's scripts/check-torchdist.py.
Outside them it flags, naming file and line:

* a collective referenced through any alias of a communicating module, called or not
  (``dist.all_reduce(...)``, ``c10d.all_reduce(...)``, ``P2POp(dist.isend, ...)``,
  ``torch.distributed.distributed_c10d.broadcast``), or imported from one;
* ``P2POp`` and ``batch_isend_irecv``;
* any use of the functional collectives and of the raw operators
  (``torch.distributed._functional_collectives``, ``torch.distributed.nn.functional``,
  ``torch.ops.c10d``, ``torch.ops._c10d_functional``), whatever is taken from them;
* ``getattr``/``vars``/``__dict__`` on a communicating module (a name could hide there);
  ``getattr(dist, "get_rank")`` with a harmless constant name is allowed;
* ``from <communicating module> import *`` and dynamic imports of one;
* ``ProcessGroup`` collective methods called on any object (``group.allreduce(...)``).

Aliases are followed through ``import ... as``, ``from ... import ... as`` and plain
assignments (``d = torch.distributed``). What it cannot see (a module passed in as an
argument) the dispatcher-level accounting still counts at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dsp_plugin

COLLECTIVES = {
    "all_to_all", "all_to_all_single", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "all_reduce", "all_reduce_coalesced", "all_gather_coalesced", "broadcast",
    "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
    "isend", "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv", "P2POp", "barrier",
    "monitored_barrier", "all_to_all_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd",
    "reduce_scatter_tensor_autograd", "permute_tensor", "all_reduce_inplace", "all_to_all_inplace",
    "all_gather_inplace", "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced",
}
#: modules whose collectives are forbidden outside comm.py
COMM_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d", "torch._C._distributed_c10d",
                "deepspeed.comm"}
#: modules that are nothing but communication: any use is forbidden outside comm.py
WHOLLY_COMM = {"torch.distributed._functional_collectives", "torch.distributed.nn.functional",
               "torch.distributed.nn", "torch.ops.c10d", "torch.ops._c10d_functional",
               "torch.ops._c10d_functional_autograd", "torch.ops.c10d_functional"}
#: ProcessGroup methods that issue a collective (unambiguous names only: no tensor has them)
PG_METHODS = {"allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
              "allgather_into_tensor_coalesced", "alltoall", "alltoall_base", "_reduce_scatter_base",
              "reduce_scatter_tensor_coalesced", "recv_anysource", "all_gather_single", "reduce_scatter_single"}
PACKAGE = Path(dsp_plugin.__file__).parent
#: the modules allowed to call collectives, relative to the package
COMM_FILES = {"comm/collectives.py", "baselines/comm.py", "deepspeed/comm.py"}


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted module path it stands for (``torch`` itself included)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    changed = True
    while changed:  # plain assignments: d = torch.distributed; f = funcol
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = _qualified(node.value, aliases)
                if path and aliases.get(node.targets[0].id) != path and _communicating(path):
                    aliases[node.targets[0].id] = path
                    changed = True
    return aliases


def _qualified(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``dist.distributed_c10d.all_reduce`` -> ``torch.distributed.distributed_c10d.all_reduce``."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _communicating(path: str) -> bool:
    return path in COMM_MODULES or any(path == m or path.startswith(m + ".") for m in WHOLLY_COMM)


def _forbidden(path: str) -> bool:
    """A collective of a communicating module, or anything of a wholly communicating one."""
    module, _, name = path.rpartition(".")
    return (module in COMM_MODULES and name in COLLECTIVES) or any(
        path == m or path.startswith(m + ".") for m in WHOLLY_COMM)


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _module_aliases(tree)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{path}:{node.lineno} {what}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for a in node.names:
                full = f"{module}.{a.name}" if module else a.name
                if module and a.name == "*" and _communicating(module):
                    flag(node, f"imports * from {module}")
                elif _forbidden(full):
                    flag(node, f"imports {full}")
        elif isinstance(node, (ast.Attribute, ast.Name)) and not isinstance(getattr(node, "ctx", None), ast.Store):
            qualified = _qualified(node, aliases)
            # report the outermost forbidden reference once, not each prefix of it
            if qualified and _forbidden(qualified) and not _forbidden(qualified.rpartition(".")[0]):
                if not (isinstance(node, ast.Name) and aliases.get(node.id) == qualified
                        and _is_import_bound(tree, node.id)):
                    flag(node, f"uses {ast.unparse(node)} ({qualified})")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else None
            target = _qualified(node.args[0], aliases) if node.args else None
            if name in ("getattr", "vars") and target and _communicating(target):
                attr = node.args[1] if name == "getattr" and len(node.args) > 1 else None
                if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)
                        and not _forbidden(f"{target}.{attr.value}")):
                    flag(node, f"looks a name up dynamically on {target}: {ast.unparse(node)}")
            if (name == "__import__" or _qualified(func, aliases) == "importlib.import_module") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                    and _communicating(node.args[0].value):
                flag(node, f"imports {node.args[0].value} dynamically")
            if isinstance(func, ast.Attribute) and func.attr in PG_METHODS:
                flag(node, f"calls the ProcessGroup method {ast.unparse(func)}")
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            target = _qualified(node.value, aliases)
            if target and _communicating(target):
                flag(node, f"reads {target}.__dict__")
    return found


def _is_import_bound(tree: ast.AST, name: str) -> bool:
    """A Name bound by an import statement (already reported at the import)."""
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in n.names)
               for n in ast.walk(tree))


def test_only_comm_modules_call_collectives() -> None:
    assert all((PACKAGE / f).is_file() for f in COMM_FILES), COMM_FILES
    files = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() not in COMM_FILES]
    assert len(files) > 5
    violations = [v for p in files for v in _violations(p)]
    assert violations == [], "collectives outside a comm.py module:\n" + "\n".join(violations)


def test_the_scan_catches_a_direct_call(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\n\ndef f(x):\n    dist.all_to_all_single(x, x)\n")
    assert _violations(bad) == [f"{bad}:4 uses dist.all_to_all_single (torch.distributed.all_to_all_single)"]
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("from torch.distributed import all_gather\nimport torch\n\ntorch.distributed.barrier()\n")
    assert _violations(sneaky) == [f"{sneaky}:1 imports torch.distributed.all_gather",
                                   f"{sneaky}:4 uses torch.distributed.barrier (torch.distributed.barrier)"]


EVASIONS = {
    "c10d module": "from torch.distributed import distributed_c10d as c10d\nc10d.all_reduce(x)\n",
    "c10d import": "import torch.distributed.distributed_c10d as c10d\nc10d.broadcast(x, 0)\n",
    "c10d path": "import torch\ntorch.distributed.distributed_c10d.all_gather_into_tensor(y, x)\n",
    "getattr constant": "import torch.distributed as dist\ngetattr(dist, 'all_reduce')(x)\n",
    "getattr dynamic": "import torch.distributed as dist\nop = 'all_' + 'reduce'\ngetattr(dist, op)(x)\n",
    "vars": "import torch.distributed as dist\nvars(dist)['all_reduce'](x)\n",
    "__dict__": "import torch.distributed as dist\ndist.__dict__['all_reduce'](x)\n",
    "functional collectives": "import torch.distributed._functional_collectives as funcol\n"
                              "funcol.all_reduce(x, 'sum', g)\n",
    "functional from": "from torch.distributed._functional_collectives import all_to_all_single\n",
    "functional anything": "from torch.distributed import _functional_collectives as fc\nfc.wait_tensor(x)\n",
    "nn functional": "import torch.distributed.nn.functional as F\nF.all_reduce(x)\n",
    "raw operators": "import torch\ntorch.ops.c10d.allreduce_([x], g, op, None, False)\n",
    "raw functional operators": "import torch\ntorch.ops._c10d_functional.all_reduce(x, 'sum', '0')\n",
    "P2POp": "import torch.distributed as dist\nops = [dist.P2POp(dist.isend, x, 1)]\n",
    "P2POp imported": "from torch.distributed import P2POp, isend\nop = P2POp(isend, x, 1)\n",
    "assigned alias": "import torch\nd = torch.distributed\nd.all_reduce(x)\n",
    "assigned function": "import torch.distributed as dist\nf = dist.all_reduce\nf(x)\n",
    "star import": "from torch.distributed import *\n",
    "dynamic import": "import importlib\nd = importlib.import_module('torch.distributed')\n",
    "group method": "def f(group, x):\n    group.allreduce([x])\n",
    "deepspeed.comm": "import deepspeed.comm as dscomm\ndscomm.all_to_all_single(y, x)\n",
}


def test_the_scan_catches_every_known_evasion_and_nothing_harmless(tmp_path: Path) -> None:
    missed = []
    for name, source in EVASIONS.items():
        file = tmp_path / f"{name.replace(' ', '_')}.py"
        file.write_text(source)
        if not _violations(file):
            missed.append(name)
    assert missed == [], f"evasions the scan misses: {missed}"
    ok = tmp_path / "ok.py"
    ok.write_text("import torch\nimport torch.distributed as dist\n"
                  "def f(x, g):\n    n = dist.get_world_size(g)\n    r = getattr(dist, 'get_rank')()\n"
                  "    y = x.gather(0, x.long())\n    return torch.distributed.is_initialized(), dist.ProcessGroup\n")
    assert _violations(ok) == []
