"""What a checkpoint directory must be on a shared filesystem (``checkpoint``'s file rules):
locks a process holds while it writes (``flock``: released however it ends), private modes
(0700 / 0600), the check that nobody else could have written a checkpoint before it is loaded
(``check_trusted``), and DCP's reader and load planner restricted to the format's own data
(metadata unpickled with its data types only; no byte entry, which DCP would unpickle with
``weights_only=False``); the manifest's own digest (``sealed`` / ``check_sealed``), the free
space a save needs (``check_space``), the cause inside DCP's per-rank failures (``cause``), and
the stateful objects' file per rank (``save_stateful`` / ``load_stateful``: a scheduler, a data
position, anything with ``state_dict`` / ``load_state_dict``, as DCP's ``Stateful``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import stat
import tempfile

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: incomplete, corrupt, untrusted, or from another
    model/TP."""


class Lock:
    """A lock file (``flock``, exclusive) this process holds: ``path`` and its descriptor."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Remove the lock file, then let go of it (a lock file nobody holds is fair game)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)


def hold_lock(directory: str, name: str) -> Lock:
    """Create ``directory/name`` locked: made under a random name, locked, then renamed, so
    nobody finds it unlocked while this process lives."""
    fd, tmp = tempfile.mkstemp(prefix=".lock-", dir=directory)
    fcntl.flock(fd, fcntl.LOCK_EX)
    path = os.path.join(directory, name)
    os.rename(tmp, path)
    return Lock(path, fd)


def lock_is_free(path: str) -> bool:
    """Whether nobody holds the lock file ``path`` (a missing one is free)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def write_private(path: str, text: str) -> None:
    """A new file ``path`` (0600; never through an existing name or link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def make_private(path: str) -> None:
    """``path`` 0700 and every file in it 0600 (DCP writes them with the umask's modes, inside
    this 0700 directory)."""
    os.chmod(path, 0o700)
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if not os.path.islink(full):
            os.chmod(full, 0o600 if os.path.isfile(full) else 0o700)


def check_trusted(path: str) -> None:
    """CheckpointError unless checkpoint ``path`` can only have been written by this account:
    the directory and every file in it owned by it and writable by nobody else (no links), its
    parent owned by it or root and writable by nobody else (or sticky: nobody else can rename
    what is in it). Whoever can write a checkpoint decides what loading it does."""
    me = os.geteuid()
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    fix = (f"copy it into a directory of your own, or make it private (chmod -R go-w "
           f"{path!r}), if you trust it")
    st = os.stat(parent)
    if st.st_uid not in (me, 0):
        raise CheckpointError(f"checkpoint {path!r}: its directory {parent!r} is owned by uid "
                              f"{st.st_uid}, not you (uid {me}), who could replace it; {fix}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise CheckpointError(f"checkpoint {path!r}: its directory {parent!r} is writable by "
                              f"others (mode {oct(stat.S_IMODE(st.st_mode))}); {fix}")
    for p in [path] + [os.path.join(path, f) for f in sorted(os.listdir(path))]:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"checkpoint {path!r}: {p!r} is a symbolic link; {fix}")
        if st.st_uid != me:
            raise CheckpointError(f"checkpoint {path!r}: {p!r} is owned by uid {st.st_uid}, not "
                                  f"you (uid {me}); {fix}")
        if st.st_mode & 0o022:
            raise CheckpointError(f"checkpoint {path!r}: {p!r} is writable by others (mode "
                                  f"{oct(stat.S_IMODE(st.st_mode))}); {fix}")


# what DCP's .metadata pickle may hold: its own data classes and enums, torch sizes and dtypes
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",
                     "torch.distributed.checkpoint.filesystem")
_METADATA_OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: a class outside ``_METADATA_*`` (a function
    to call, any other object) is an error, not a call."""

    def find_class(self, module: str, name: str):
        obj = None
        if module in _METADATA_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if not (isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                               or issubclass(obj, enum.Enum))):
                obj = None
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        elif (module, name) in _METADATA_OTHERS:
            obj = super().find_class(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's "
                                         f"metadata")
        return obj


def reader(path: str):
    """DCP's file reader whose metadata is read by ``_MetadataUnpickler``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            name = os.path.join(path, ".metadata" if rank is None else f"__{rank}.metadata")
            with open(name, "rb") as f:
                md = _MetadataUnpickler(f).load()
            if not isinstance(md, dcp_metadata.Metadata):
                raise CheckpointError(f"{name} holds no checkpoint metadata")
            if hasattr(dcp_metadata, "StorageMeta") and hasattr(self, "load_id"):
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = dcp_metadata.StorageMeta()
                md.storage_meta.load_id = self.load_id
            return md

    return Reader(path)


def planner():
    """DCP's default load planner, refusing byte entries: DCP unpickles them with
    ``weights_only=False``, and this format holds tensors only."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            raise CheckpointError(f"entry {read_item.dest_index.fqn!r} is stored as pickled "
                                  f"bytes, not a tensor: not a zero-repro checkpoint")

    return Planner()


# ------------------------------------------------------------------ the manifest's own digest
DIGEST = "digest"  # the manifest's key holding the SHA-256 of the rest of it


def _canonical(doc: dict) -> bytes:
    return json.dumps({k: v for k, v in doc.items() if k != DIGEST}, sort_keys=True,
                      separators=(",", ":")).encode()


def sealed(doc: dict) -> str:
    """``doc`` as the manifest's text, with the SHA-256 of its canonical JSON (sorted keys, no
    spaces, ``digest`` left out) under ``digest``: a flipped bit anywhere in it is seen."""
    return json.dumps({**doc, DIGEST: hashlib.sha256(_canonical(doc)).hexdigest()}, indent=1)


def check_sealed(doc: dict, mpath: str) -> None:
    """CheckpointError unless ``doc`` (read from ``mpath``) carries its own intact digest."""
    if hashlib.sha256(_canonical(doc)).hexdigest() != doc.get(DIGEST):
        what = "has no digest" if DIGEST not in doc else "does not match its own digest"
        raise CheckpointError(f"checkpoint manifest {mpath!r} is damaged: it {what} (a changed "
                              f"byte in it, e.g. its step, would resume the wrong state); "
                              f"resume from an earlier checkpoint")


# ------------------------------------------------------------------ space and causes
def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still write on ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_space(directory: str, need: int, step: int) -> None:
    """CheckpointError before a save of ``need`` bytes (every rank's) that cannot fit."""
    free = free_bytes(directory)
    if need > free:
        raise CheckpointError(
            f"checkpoint step {step}: not enough disk space in {directory!r}: the save needs "
            f"{need:,} bytes (every rank's shards), {free:,} are free; free some space, lower "
            f"checkpoint.keep, or save elsewhere (checkpoint.dir)")


def cause(e: BaseException) -> str:
    """One line naming what went wrong inside a DCP call: its per-rank failures (``rank r:
    Type: message``) where DCP wrapped them in a ``CheckpointException``, else ``e`` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {_one_line(inner)}")
        return "; ".join(parts)
    return _one_line(e)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        text += " (the disk is full)"
    elif isinstance(e, EOFError):
        text += " (a file ended early)"
    return f"{type(e).__name__}: {text[:400]}"


# ------------------------------------------------------------------ stateful objects
def stateful_name(rank: int) -> str:
    return f"stateful_rank{rank}.pt"


def save_stateful(directory: str, rank: int, stateful: dict) -> None:
    """Each object's ``state_dict()`` into ``directory/stateful_rank{rank}.pt`` (0600)."""
    states = {}
    for key, obj in stateful.items():
        if not callable(getattr(obj, "state_dict", None)) or \
                not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"stateful[{key!r}]: a {type(obj).__name__} has no state_dict() / "
                            f"load_state_dict(); pass a scheduler, a data position, or any "
                            f"object with both")
        states[key] = obj.state_dict()
    path = os.path.join(directory, stateful_name(rank))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save(states, f)


def load_stateful(directory: str, rank: int, stateful: dict, path_for_msg: str) -> None:
    """Restore each object of ``stateful`` from ``directory/stateful_rank{rank}.pt`` (plain
    data only: ``weights_only``)."""
    path = os.path.join(directory, stateful_name(rank))
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path_for_msg!r} holds no stateful objects (saved "
                              f"without stateful=); cannot restore {sorted(stateful)}")
    states = torch.load(path, weights_only=True)
    missing = sorted(set(stateful) - set(states))
    if missing:
        raise CheckpointError(f"checkpoint {path_for_msg!r} holds the stateful objects "
                              f"{sorted(states)}, not {missing}")
    for key, obj in stateful.items():
        obj.load_state_dict(states[key])
