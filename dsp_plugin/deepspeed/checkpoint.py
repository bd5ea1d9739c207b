"""DeepSpeed checkpoints that cannot load mixed: one tag per save, ``latest`` last, a manifest checked at load.

DeepSpeed writes each rank's files itself and rank 0 writes ``latest`` as soon
as its own files are done, so a save interrupted on another rank, or a save over
an existing tag, can leave a checkpoint whose files come from different saves;
DeepSpeed loads it without a word. ``save`` and ``load`` wrap the engine's own
calls:

``save(engine, save_dir, step=..., client_state=...)``
    1. checks that ``save_dir`` can be written (a clear error, before any collective);
    2. agrees on a per-save id (rank 0's, one tiny all-gather) and saves under
       the new tag ``step{step}-{id}``, with the id in the client state;
       and the ``universal_checkpoint_info`` ``ds_to_universal`` requires;
       each rank also writes its RNG states (``dsp_rng_rank{r}.pt``: torch's CPU
       generator, the current CUDA device's, ``numpy.random``, ``random``), which
       DeepSpeed does not keep: the noise, timesteps and dropout masks a training
       step draws after a resume are those the uninterrupted run drew;
    3. each rank hashes its share of the tag's files (blake2b) into
       ``dsp_manifest_rank{r}.json``; after every rank has written, rank 0
       writes ``latest`` (atomically): an interrupted save never becomes latest.

``load(engine, load_dir)``
    refuses, with the same message on every rank and before DeepSpeed reads a
    byte, a directory that does not exist, one without ``latest``, a tag without
    model states, a tag without manifests, manifests of different saves, and any
    file whose bytes differ from its save's manifest; then loads with DeepSpeed
    and checks the client state's id against the manifests. Each rank restores
    its RNG states from the save of the same rank when the world size is the
    saving one (``load_rng=False``: not at all); at another world size nothing
    maps one rank's draws onto another's, and rank 0 says they were not restored.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin import rng
from dsp_plugin.deepspeed.comm import all_gather_rows
from dsp_plugin.log import get_logger
from dsp_plugin.topology import get_topology

__all__ = ["SAVE_ID_KEY", "CheckpointError", "check_load_dir", "check_save_dir", "load", "save", "saved_sizes"]

SAVE_ID_KEY = "dsp_save_id"
_MANIFEST = "dsp_manifest_rank{}.json"
_RNG = "dsp_rng_rank{}.pt"


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be saved to or loaded from; raised alike on every rank."""


def check_save_dir(save_dir: str | os.PathLike) -> Path:
    """Create ``save_dir`` if needed and prove it writable; a ``CheckpointError`` naming it otherwise."""
    path = Path(save_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dsp_write_test"):
            pass
    except OSError as exc:
        raise CheckpointError(f"--save-dir {str(path)!r} cannot be written ({type(exc).__name__}: {exc}); "
                              f"expected a directory this user can create and write (checked before training, "
                              f"so no step is lost)") from None
    return path


def _hash(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(tag_dir: Path) -> list[Path]:
    return sorted(p for p in tag_dir.rglob("*") if p.is_file() and not p.name.startswith("dsp_manifest_rank"))


def _agreed_id(device: Any) -> str:
    mine = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    return f"{int(all_gather_rows(mine)[0, 0]):016x}"


def _universal_info() -> dict[str, Any]:
    """What ``ds_to_universal`` requires of a checkpoint (tp = pp = 1 here: the format version alone)."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def save(engine: Any, save_dir: str | os.PathLike, *, step: int, client_state: dict[str, Any] | None = None) -> str:
    """Save under a new tag, write this rank's manifest, then ``latest`` (rank 0); returns the tag."""
    path = check_save_dir(save_dir)
    device = torch.device(engine.device) if hasattr(engine, "device") else torch.device("cpu")
    save_id = _agreed_id(device)
    tag = f"step{step}-{save_id}"
    state = dict(client_state or {}, **{SAVE_ID_KEY: save_id}, **_universal_info())
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        (path / tag).mkdir(parents=True, exist_ok=True)
        torch.save(rng.states(device), path / tag / _RNG.format(rank))  # before the save's closing barrier
        engine.save_checkpoint(str(path), tag=tag, client_state=state, save_latest=False)  # ends with a barrier
        files = _files(path / tag)
        mine = {str(f.relative_to(path / tag)): _hash(f) for i, f in enumerate(files) if i % world == rank}
        manifest = {"save_id": save_id, "tag": tag, "world_size": world, "dsp_size": _dsp_size(), "files": mine}
        (path / tag / _MANIFEST.format(rank)).write_text(json.dumps(manifest, indent=1))
    except (OSError, RuntimeError) as exc:
        full = _write_failure(exc, path / tag)
        if full is None:
            raise
        raise full from exc
    all_gather_rows(torch.ones(1, device=device))  # every manifest is written before latest
    if rank == 0:
        tmp = path / ".latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, path / "latest")
    return tag


def _write_failure(exc: BaseException, where: Path) -> CheckpointError | None:
    """A ``CheckpointError`` naming the path and its filesystem's free space when ``exc`` is a failed write
    (no space, a quota, a file size limit), else None. DeepSpeed's own error names neither: torch.save's
    zip writer reports a short write as "file write failed" or "unexpected pos N vs M", without the errno."""
    codes = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
    text = str(exc)
    short_write = any(m in text for m in ("write failed", "unexpected pos", "No space left", "Disk quota"))
    if not ((isinstance(exc, OSError) and exc.errno in codes) or short_write):
        return None
    existing = next(p for p in (where, *where.parents) if p.exists())
    usage = shutil.disk_usage(existing)
    mount = existing.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    return CheckpointError(f"saving checkpoint {str(where)!r} failed writing ({text.splitlines()[0][:200]}): the "
                           f"filesystem mounted at {str(mount)!r} has {usage.free / 2**30:.2f} GiB free of "
                           f"{usage.total / 2**30:.2f} GiB (or a quota or file-size limit was hit); free space "
                           f"there or pass another --save-dir. The previous complete save is still 'latest'.")


def _dsp_size() -> int | None:
    topology = get_topology()
    return None if topology is None else topology.dsp


def saved_sizes(load_dir: str | os.PathLike) -> dict[str, int | None]:
    """``{"world_size", "dsp_size"}`` of the save ``latest`` names, from its manifest (files only, no collective),
    so a launch can refuse a resume at other sizes before it starts; ``dsp_size`` is None for a save made without
    an installed topology or before manifests recorded it. Call after ``check_load_dir``."""
    path = Path(load_dir)
    record = json.loads((path / (path / "latest").read_text().strip() / _MANIFEST.format(0)).read_text())
    return {"world_size": record.get("world_size"), "dsp_size": record.get("dsp_size")}


def check_load_dir(load_dir: str | os.PathLike) -> tuple[str, str]:
    """(tag, save id) of the complete checkpoint ``latest`` names; a ``CheckpointError`` otherwise.

    Reads only files, no collective: every rank reaches the same verdict on a
    shared filesystem. Hashes every file of the tag against its manifest.
    """
    path = Path(load_dir)
    if not path.is_dir():
        raise CheckpointError(f"--load-dir {str(path)!r} does not exist or is not a directory; expected a "
                              f"directory written by --save-dir (drop --load-dir to start from scratch)")
    latest = path / "latest"
    if not latest.is_file():
        tags = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise CheckpointError(f"--load-dir {str(path)!r} has no 'latest' file, so no save into it completed "
                              f"(tags present: {tags or 'none'}); expected a directory written by --save-dir")
    tag = latest.read_text().strip()
    tag_dir = path / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"--load-dir {str(path)!r}: 'latest' names tag {tag!r}, which does not exist")
    if not any(tag_dir.glob("*model_states.pt")):
        raise CheckpointError(f"checkpoint {str(tag_dir)!r} has no model states (*model_states.pt): not a "
                              f"DeepSpeed engine checkpoint, or its save was interrupted; expected the files "
                              f"engine.save_checkpoint writes")
    manifests = sorted(tag_dir.glob("dsp_manifest_rank*.json"))
    if not manifests:
        raise CheckpointError(f"checkpoint {str(tag_dir)!r} has no dsp_manifest_rank*.json, so nothing shows its "
                              f"files come from one save; expected a checkpoint written by "
                              f"dsp_plugin.deepspeed.checkpoint.save (dsp_plugin.launch.train_deepspeed --save-dir)")
    records = [json.loads(m.read_text()) for m in manifests]
    ids = {m.name: r["save_id"] for m, r in zip(manifests, records)}
    world = records[0].get("world_size", len(records))
    if len(set(ids.values())) > 1 or len(records) > world:
        raise CheckpointError(f"checkpoint {str(tag_dir)!r} mixes saves: manifests {ids} (expected {world}, "
                              f"one per saving rank, all of one save)")
    if len(records) < world:
        missing = sorted(set(_MANIFEST.format(r) for r in range(world)) - set(ids))
        raise CheckpointError(f"checkpoint {str(tag_dir)!r} is missing manifest(s) {missing} of its {world} saving "
                              f"ranks (deleted, or the save stopped before every rank wrote its own); refusing to "
                              f"load files nothing vouches for (restore them, or point 'latest' at an earlier "
                              f"complete tag)")
    expected = {name: digest for r in records for name, digest in r["files"].items()}
    present = {str(f.relative_to(tag_dir)) for f in _files(tag_dir)}
    missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
    changed = sorted(name for name in set(expected) & present if _hash(tag_dir / name) != expected[name])
    if missing or extra or changed:
        raise CheckpointError(f"checkpoint {str(tag_dir)!r} holds files that are not from save "
                              f"{records[0]['save_id']}: changed {changed}, missing {missing}, unexpected "
                              f"{extra}; refusing to load a mix of saves (restore the whole tag directory, or "
                              f"point 'latest' at an earlier complete tag)")
    return tag, records[0]["save_id"]


def load(engine: Any, load_dir: str | os.PathLike, *, load_rng: bool = True) -> dict[str, Any]:
    """Check ``load_dir`` (``check_load_dir``), load it with DeepSpeed, restore this rank's RNG states
    (unless ``load_rng=False``), return the client state."""
    tag, save_id = check_load_dir(load_dir)
    _, client = engine.load_checkpoint(str(load_dir), tag=tag)
    if client is None or client.get(SAVE_ID_KEY) != save_id:
        found = None if client is None else client.get(SAVE_ID_KEY)
        raise CheckpointError(f"checkpoint {str(Path(load_dir) / tag)!r}: the model states say save {found}, "
                              f"the manifests {save_id}; refusing a mix of saves")
    if load_rng:
        _load_rng(Path(load_dir) / tag, engine)
    return client


def _load_rng(tag_dir: Path, engine: Any) -> None:
    """This rank's RNG states from the same rank's file, when the checkpoint was saved at this world size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved_world = json.loads((tag_dir / _MANIFEST.format(0)).read_text()).get("world_size", world)
    rng_file = tag_dir / _RNG.format(rank)
    if saved_world != world or not rng_file.is_file():
        why = f"it was saved by {saved_world} ranks, this run has {world}" if saved_world != world else \
            f"it holds no {_RNG.format(rank)} (saved before they were kept)"
        get_logger(__name__).warning("checkpoint %s: RNG states not restored (%s): the random draws after the "
                                     "resume are not the uninterrupted run's", tag_dir, why)   # rank 0 prints
        return
    device = torch.device(engine.device) if hasattr(engine, "device") else torch.device("cpu")
    rng.restore(torch.load(rng_file, map_location="cpu", weights_only=True), device)
