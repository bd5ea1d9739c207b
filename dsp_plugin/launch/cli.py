"""The console scripts' entry points: ``--version`` and a missing extra answered before the launch is imported.

Each console script of ``pyproject.toml`` points here. ``dsp-pretrain-stdit --help`` without Megatron,
for example, says ``dsp-pretrain-stdit: error: megatron.core is not installed; install the extra: pip
install 'dsp_plugin[megatron]'`` instead of a ``ModuleNotFoundError`` traceback; ``--version`` answers
without importing the launch (so without its extra). ``python -m dsp_plugin.launch.<name>`` runs the
launch's module directly.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator

__all__ = ["SCRIPTS", "argument_errors", "missing_extra", "require_extra", "usage_error", "warn_renamed"]

#: console script -> (module:function, extra, modules the launch imports at the top)
SCRIPTS: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "dsp-train": ("dsp_plugin.launch.train_dsp:main", None, ()),
    "dsp-sample": ("dsp_plugin.launch.sample:main", "diffusers", ("diffusers", "transformers")),
    "dsp-sample-latte": ("dsp_plugin.launch.sample_latte:main", "diffusers", ("diffusers", "transformers")),
    "dsp-train-deepspeed": ("dsp_plugin.launch.train_deepspeed:main", "deepspeed", ("deepspeed",)),
    "dsp-pretrain-stdit": ("dsp_plugin.launch.pretrain_stdit:main", "megatron", ("megatron.core",)),
    "dsp-bench": ("dsp_plugin.bench.__main__:main", "bench", ()),
    "dsp-dryrun": ("dsp_plugin.dryrun.cli:main", None, ()),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):      # a missing parent package, or one blocked in sys.modules
        return False


def missing_extra(prog: str) -> str | None:
    """The one-line error for ``prog`` when a module its launch imports is missing, else None."""
    _, extra, modules = SCRIPTS[prog]
    for module in modules:
        if not _installed(module):
            return f"{prog}: error: {module} is not installed; install the extra: pip install 'dsp_plugin[{extra}]'"
    return None


def require_extra(prog: str) -> None:
    message = missing_extra(prog)
    if message is not None:
        print(message, file=sys.stderr)
        raise SystemExit(2)


def usage_error(prog: str, message: str, exc: BaseException | None = None) -> None:
    """An argument error as one line, ``<prog>: error: <message>``, and exit status 2 (argparse's form).

    Under torchrun (``TORCHELASTIC_ERROR_FILE`` set) the error is also written to this rank's error file, so
    torchrun's summary names it as it names an exception; no traceback is printed."""
    prefix = f"{prog}: "
    message = message[len(prefix):] if message.startswith(prefix) else message
    line = f"{prog}: error: {message}"
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if exc is not None and error_file:   # torchrun's format (ErrorHandler.record_exception), the line as traceback
        import json
        import time

        record = {"message": f"{type(exc).__name__}: {exc}",
                  "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        with open(error_file, "w") as f:
            json.dump({"message": record}, f)
    raise SystemExit(2)


@contextlib.contextmanager
def argument_errors(prog: str, *errors: type[BaseException]) -> Iterator[None]:
    """Checks that need only the arguments (run alike on every rank, before any collective): a ``ValueError``
    (or one of ``errors``) they raise becomes ``usage_error``'s one line and exit 2 on every rank instead of a
    traceback per rank."""
    try:
        yield
    except (ValueError, *errors) as exc:
        usage_error(prog, str(exc), exc)


def warn_renamed(prog: str, argv: list[str], renamed: dict[str, str]) -> list[str]:
    """Warn (rank 0, the ``dsp_plugin`` logger) for each old flag spelling in ``argv``; return the warnings.

    One flag style across our scripts: hyphens, as torchrun's and Megatron's. The old underscore spellings stay
    accepted as aliases (``add_argument("--save-dir", "--save_dir", ...)``) and say so."""
    from dsp_plugin.log import get_logger, setup

    setup()
    said = []
    for old, new in renamed.items():
        if any(a == old or a.startswith(old + "=") for a in argv):
            said.append(f"{prog}: {old} is deprecated; use {new}")
            get_logger("dsp_plugin.launch").warning(said[-1])
    return said


def _run(prog: str) -> object:
    from dsp_plugin import __version__

    if sys.argv[1:2] == ["--version"]:
        print(f"{prog} (dsp_plugin) {__version__}")
        raise SystemExit(0)
    require_extra(prog)
    module, function = SCRIPTS[prog][0].split(":")
    result = getattr(importlib.import_module(module), function)()
    # the console-script wrapper hands this to sys.exit: a main's results (a list of per-rank dicts) would print
    # and exit 1; only an int is an exit status
    return result if type(result) is int else None


def train() -> object:
    return _run("dsp-train")


def sample() -> object:
    return _run("dsp-sample")


def sample_latte() -> object:
    return _run("dsp-sample-latte")


def train_deepspeed() -> object:
    return _run("dsp-train-deepspeed")


def pretrain_stdit() -> object:
    return _run("dsp-pretrain-stdit")


def bench() -> object:
    return _run("dsp-bench")


def dryrun() -> object:
    return _run("dsp-dryrun")
