"""Resharding checkpoints of ZeRO-DP training state with torch.distributed.checkpoint (DCP).

Saved (paper §5, the model states ZeRO partitions: 12Ψ/N_d bytes per rank for stages 1-3): per
parameter its fp32 master and each per-element optimizer state (the built-in AdamW's
``exp_avg`` and ``exp_avg_sq``; a torch optimizer's, e.g. SGD's ``momentum_buffer``) as 1-D
tensors of its TP-local size (``master/tp{t}/{param}``, ...); training-dtype parameters are the
master cast down and are not saved; a torch optimizer's scalar states and param groups go into
the manifest. Scalars (data position, Adam step, loss-scaler state, the layout) and a SHA-256 per file
go into ``manifest.json``, itself sealed by a SHA-256 of its own content (``digest``); per-rank RNG
states into ``rng/rank{r}``; ``stateful={"sched": scheduler, ...}`` (any object with
``state_dict`` / ``load_state_dict``, DCP's ``Stateful``) into ``stateful_rank{r}.pt``, restored
by ``load(..., stateful=...)`` (the same rank's, or rank 0's when the world size changed).

Resharding: a rank's shard (``zero/partition.py``: interleaved bucket chunks) intersected with
the parameter slots gives ``Piece``s (param, offset, length); each rank hands DCP a
``ShardedTensor`` per parameter of its pieces (elements it does not hold are placeholder "gap"
shards: no metadata all-gather), so every element is written once, by its owner, and a load
into any stage, DP size, shard group size (``zero.shard_size``: a shard under G is the partition
over G; its replicas hold the same pieces and only the first replica writes them) or bucket size
reads only the overlapping bytes. Invariant (tested):
resume(save(state)) equals the uninterrupted state elementwise, bit for bit at the same
layout. TP resharding is not supported (``CheckpointError``).

Commit protocol: DCP writes ``step_N.<random>.partial/`` (this save's own: the coordinator
holds its lock, ``.step_N.<random>.partial.lock``, until the commit), the coordinator writes
the manifest (the commit marker), renames it to ``step_N`` and updates ``latest``. Runs sharing
a directory (the lab's runs that differ only in ``train.steps``: the same state at every step)
never remove each other's saves in progress: a save removes only interrupted saves whose lock is
free, keeps a ``step_N`` another run committed first, and prunes committed checkpoints past
``keep`` that no load is reading (a load holds a shared lock on their manifest). A missing
manifest, a hash mismatch, a different model or TP degree raise ``CheckpointError`` before any
tensor is loaded; a damaged manifest (its digest) is refused, naming the file. A save first checks
that every rank's bytes fit on the filesystem (a full disk is said in one line, with the bytes
needed and free); DCP's per-rank failures are reported with their cause.

Trust: directories are written 0700 and files 0600; ``load`` refuses (``CheckpointError``) a
checkpoint whose directory, files or parent another account owns or may write, unless
``trust=True`` (loading one runs what its writer chose); DCP's metadata is unpickled with only
its own data types allowed, and no entry goes through ``torch.load(weights_only=False)``.
Entry points: ``save``, ``load``, ``check_trusted``, ``latest``, ``committed``,
``check_compatible``.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import warnings
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.train import checkpoint_files as files
from zero_repro.runtime.train.checkpoint_files import CheckpointError, check_trusted  # noqa: F401
from zero_repro.runtime.zero.partition import intersect

log = logging.getLogger(__name__)

FORMAT = "zero-repro-dcp/2"  # /2: the manifest carries its own digest
OLD_FORMATS = ("zero-repro-dcp/1",)  # read with a warning: no digest
MANIFEST = "manifest.json"
LATEST = "latest"
STATES = ("master", "exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"step_\d{8}$")  # a committed (or damaged) checkpoint's name
PARTIAL = ".partial"  # the end of a save's name until its commit


def _dcp():
    """torch.distributed.checkpoint and the ShardedTensor types, imported on first use: they
    pull in DTensor's op registry (~1.5 s), which every CLI start and every rank that never
    saves would pay for."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard
    from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                  TensorProperties)
    return dcp, ShardMetadata, Shard, ShardedTensorBase, ShardedTensorMetadata, TensorProperties


@dataclass(frozen=True)
class Piece:
    """Elements [offset, offset + length) of parameter ``name`` (flattened), stored at
    ``shard_offset`` of its group's shard tensors."""

    name: str
    offset: int
    length: int
    shard_offset: int


def pieces(group: dict) -> list[Piece]:
    """This rank's pieces of one group of ``Strategy.state_dict()`` (padding excluded)."""
    out = []
    for flat_start, shard_start, length in group["shard_ranges"]:
        for name, off, numel, _shape in group["slots"]:
            r = intersect(off, off + numel, flat_start, flat_start + length)
            if r is not None:
                out.append(Piece(name, r[0] - off, r[1] - r[0], shard_start + r[0] - flat_start))
    return out


def _sharded(chunks: list[tuple[int, torch.Tensor]], numel: int, rank: int):
    """A 1-D ShardedTensor of ``numel`` elements whose local shards are ``chunks`` =
    [(global offset, 1-D tensor)], the rest described as placeholder gaps."""
    _, ShardMetadata, Shard, ShardedTensorBase, ShardedTensorMetadata, TensorProperties = _dcp()
    chunks = sorted(chunks, key=lambda c: c[0])
    t0 = chunks[0][1] if chunks else torch.empty(0)
    dev = "cpu" if t0.device.type == "cpu" else str(t0.device)
    local = [Shard(t, ShardMetadata([off], [t.numel()], f"rank:{rank}/{dev}"))
             for off, t in chunks]
    metas, pos = [s.metadata for s in local], 0
    for off, t in chunks + [(numel, None)]:
        if off > pos:  # elements held elsewhere (other ranks' pieces)
            metas.append(ShardMetadata([pos], [off - pos], f"rank:{rank}/{dev}"))
        pos = off + (t.numel() if t is not None else 0)
    props = TensorProperties(dtype=torch.float32)
    md = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([numel]),
                               tensor_properties=props)
    # the base-class initializer does no cross-rank communication or validation (see docstring)
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(local, md)
    # what ShardedTensor's own initializer sets (_prepare_init), without its requirement of an
    # initialised default group: DCP only reads local shards and metadata
    st._init_rrefs, st._sharded_tensor_id, st._remote_shards = False, None, {}
    st._process_group = None
    return st


def _state_tensors(sd: dict, tp_rank: int, rank: int, writer: bool) -> dict:
    """DCP state dict of ShardedTensors over ``sd`` (a Strategy.state_dict()); the local shards
    are views of ``sd``'s shard tensors, so a DCP load fills ``sd`` in place."""
    numel = {name: n for g in sd["groups"] for name, _, n, _ in g["slots"]}
    states = sd.get("states", STATES)
    chunks: dict[str, list] = {f"{k}/tp{tp_rank}/{n}": [] for k in states for n in numel}
    for g in sd["groups"]:
        # stage 0 keeps the full state on every DP rank: only DP rank 0 writes it; replicas of
        # a shard (``zero.shard_size`` < N_d) hold the same pieces: only the first writes them
        if not writer and (g["partition"]["world"] == 1 or sd.get("replica_rank", 0)):
            continue
        for pc in pieces(g):
            for k in states:
                chunks[f"{k}/tp{tp_rank}/{pc.name}"].append(
                    (pc.offset, g[k][pc.shard_offset:pc.shard_offset + pc.length]))
    # keys this rank holds nothing of are left out: DCP needs no rank to list every key, and an
    # empty ShardedTensor cannot even tell its device without a process group
    return {key: _sharded(c, numel[key.split("/", 2)[2]], rank)
            for key, c in chunks.items() if c}


def _files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f != MANIFEST)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _dcp_kwargs(topo: Topology) -> dict:
    if topo.world.size == 1:  # one process (or a one-rank sub-world): no collectives
        return {"no_dist": True}
    return {"process_group": topo.world.pg}


@contextmanager
def _quiet():
    """DCP warns on every call that ShardedTensor is deprecated in favour of DTensor (DTensor
    cannot describe ZeRO's interleaved chunks) and that a one-process save has no group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


def _rng_state() -> torch.Tensor:
    return torch.get_rng_state().clone()


# ------------------------------------------------------------------------------------ save
def _lock_of(partial_name: str) -> str:
    return f".{partial_name}.lock"


def save(root: str, strategy, topo: Topology, step: int, keep: int = 2,
         extra: dict | None = None, stateful: dict | None = None) -> str:
    """Collective over ``topo.world``: save the training state after ``step`` steps (the data
    position to resume from) into ``root/step_{step}`` (``root`` made 0700 if new); return
    that directory. ``extra``: JSON data for the manifest; ``stateful``: name -> object with
    ``state_dict()`` (an LR scheduler, a data position), each rank's own."""
    final = os.path.join(root, f"step_{step:08d}")
    coordinator = topo.world.rank == 0
    lock, name = None, ""
    if coordinator:
        os.makedirs(root, mode=0o700, exist_ok=True)
        name = f"step_{step:08d}.{secrets.token_hex(6)}{PARTIAL}"
        lock = files.hold_lock(root, _lock_of(name))
        os.mkdir(os.path.join(root, name), 0o700)
    try:
        sd = strategy.state_dict()
        state = _state_tensors(sd, topo.tp_rank, comm.world_rank(), writer=topo.dp_rank == 0)
        state[f"rng/rank{topo.rank}"] = _rng_state()
        # the coordinator's directory for this save, made before anybody writes, and whether
        # every rank's bytes fit there (decided once, by the coordinator, for every rank)
        gathered = comm.all_gather_object((name, _nbytes(state)), topo.world)
        partial = os.path.join(root, gathered[0][0])
        full = None
        if coordinator:
            try:
                files.check_space(partial, sum(n for _, n in gathered) + SPACE_MARGIN, step)
            except CheckpointError as e:
                full = str(e)
        full = comm.all_gather_object(full, topo.world)[0]
        if full is not None:
            raise CheckpointError(full)
        if stateful:
            files.save_stateful(partial, topo.rank, stateful)
        try:
            with _quiet():
                dcp = _dcp()[0]
                dcp.save(state, storage_writer=dcp.FileSystemWriter(partial),
                         **_dcp_kwargs(topo))
        # DCP wraps per-rank failures in its own type (a BaseException)
        except (Exception, _checkpoint_exception()) as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint step {step} could not be written to {partial!r}"
                                  f": {files.cause(e)}") from e
        if coordinator:
            files.make_private(partial)
            manifest = {
                "format": FORMAT, "step": int(step), "stage": sd["stage"], "dtype": sd["dtype"],
                "dp": topo.dp, "tp": topo.tp, "world_size": topo.world_size,
                "opt_step": int(sd["step"]), "scaler": sd["scaler"],
                "states": list(sd.get("states", STATES)), "optim": sd.get("optim"),
                "params": {n: list(shape) for g in sd["groups"] for n, _, _, shape in g["slots"]},
                "files": {f: _sha256(os.path.join(partial, f)) for f in _files(partial)},
                "extra": extra or {}}
            files.write_private(os.path.join(partial, MANIFEST), files.sealed(manifest))
            _commit(partial, final)
            _write_latest(root, os.path.basename(final))
            _prune(root, keep)
            log.info("checkpoint saved: %s (step %d, stage %d, dp %d, tp %d)", final, step,
                     sd["stage"], topo.dp, topo.tp)
    finally:
        if lock is not None:
            lock.release()
    comm.barrier(topo.world)  # the checkpoint is committed before anyone goes on
    return final


SPACE_MARGIN = 1 << 20  # DCP's metadata file and the manifest, over the shards' own bytes


def _damaged(path: str, manifest: dict) -> str:
    """After a failed unverified load: which of the checkpoint's files fail their SHA-256."""
    bad = [name for name, digest in manifest.get("files", {}).items()
           if not os.path.isfile(os.path.join(path, name))
           or _sha256(os.path.join(path, name)) != digest]
    if not bad:
        return "every file matches its SHA-256"
    return (f"file {bad[0]!r}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} does not "
            f"match its SHA-256 in {MANIFEST}: truncated or damaged")


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def _nbytes(state: dict) -> int:
    """Bytes this rank writes of DCP state ``state`` (its local shards and tensors)."""
    n = 0
    for v in state.values():
        shards = getattr(v, "local_shards", None)
        if shards is not None:  # a ShardedTensor: its local shards
            n += sum(s.tensor.numel() * s.tensor.element_size() for s in shards())
        else:
            n += v.numel() * v.element_size()
    return n


def _commit(partial: str, final: str) -> None:
    """Rename this save's ``partial`` to ``final``. A ``final`` another run committed first (its
    manifest written: the same state, runs sharing a directory differ only in their length) is
    kept and this save dropped; a damaged one (no manifest: nobody loads it) is replaced."""
    try:
        os.rename(partial, final)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if os.path.isfile(os.path.join(final, MANIFEST)):
        log.info("checkpoint %s was committed by another run meanwhile: kept", final)
        shutil.rmtree(partial, ignore_errors=True)
        return
    aside = partial[:-len(PARTIAL)] + ".damaged"
    os.rename(final, aside)
    os.rename(partial, final)
    shutil.rmtree(aside, ignore_errors=True)


def _write_latest(root: str, name: str) -> None:
    """``root/latest`` names ``name``: written under a fresh random name (never through a name
    or link someone placed there), then renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{LATEST}-", dir=root)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


def discard_partial(root: str) -> list[str]:
    """Remove the interrupted saves under ``root`` (``step_N…partial`` directories no manifest
    committed; ``latest`` and ``load`` never take one) whose lock is free: their save is no
    longer running, whichever run made them. A save in progress (its lock held) stays. Returns
    what was removed."""
    if not os.path.isdir(root):
        return []
    gone = []
    for d in sorted(os.listdir(root)):
        path = os.path.join(root, d)
        if d.startswith("step_") and d.endswith(PARTIAL) and os.path.isdir(path):
            lock = os.path.join(root, _lock_of(d))
            if files.lock_is_free(lock):
                shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                gone.append(path)
        elif d.startswith(".step_") and d.endswith(f"{PARTIAL}.lock") and \
                not os.path.exists(os.path.join(root, d[1:-len(".lock")])) and \
                files.lock_is_free(path):
            with contextlib.suppress(FileNotFoundError):  # a save ended before removing it
                os.unlink(path)
    return gone


def _prune(root: str, keep: int) -> None:
    """Interrupted saves (``discard_partial``), and the committed checkpoints older than the
    newest ``keep`` that no load is reading (0: keep all)."""
    discard_partial(root)
    if keep <= 0:
        return
    done = sorted(d for d in os.listdir(root) if STEP_DIR.match(d))
    for d in done[:-keep]:
        path = os.path.join(root, d)
        try:
            fd = os.open(os.path.join(path, MANIFEST), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)  # damaged: nobody loads it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # being loaded: it stays
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------ load
def committed(root: str) -> list[str]:
    """The committed checkpoints under ``root`` (those with a manifest), newest first."""
    if not os.path.isdir(root):
        return []
    steps = sorted((d for d in os.listdir(root) if STEP_DIR.match(d)), reverse=True)
    return [os.path.join(root, d) for d in steps
            if os.path.isfile(os.path.join(root, d, MANIFEST))]


def latest(root: str) -> str | None:
    """The newest committed checkpoint under ``root``, or None if there is none. ``root/latest``
    is only a hint: a newer step directory without a manifest (a save interrupted before its
    commit, or a manifest deleted since) is passed over for the newest one that has one."""
    found = committed(root)
    ptr = os.path.join(root, LATEST)
    if found and os.path.isfile(ptr):
        with open(ptr) as f:
            hinted = os.path.join(root, f.read().strip())
        if hinted not in found:
            log.warning("checkpoint %s is not committed (no %s): using %s", hinted, MANIFEST,
                        found[0])
    return found[0] if found else None


def uncommitted(root: str) -> list[str]:
    """Step directories under ``root`` without a manifest (interrupted saves, deleted
    manifests), for messages."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root)
                  if d.startswith("step_") and not os.path.isfile(os.path.join(root, d, MANIFEST)))


def read_manifest(path: str, verify: bool = True) -> dict:
    """The manifest of checkpoint ``path``; CheckpointError if incomplete or corrupt."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"checkpoint {path!r} is incomplete (no {MANIFEST}: the save was "
                              f"interrupted); resume from an earlier one")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r}: unreadable {MANIFEST} ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, *OLD_FORMATS):
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {path!r} has format {got!r}, expected {FORMAT!r}")
    if manifest["format"] == FORMAT:
        files.check_sealed(manifest, mpath)
    else:
        log.warning("checkpoint %s was written in format %s: its manifest carries no digest "
                    "(damage to it cannot be seen)", path, manifest["format"])
    if verify:
        for name, digest in manifest["files"].items():
            fpath = os.path.join(path, name)
            if not os.path.isfile(fpath):
                raise CheckpointError(f"checkpoint {path!r} is missing file {name!r}")
            if _sha256(fpath) != digest:
                raise CheckpointError(f"checkpoint {path!r} is corrupt: file {name!r} does not "
                                      f"match its SHA-256 in {MANIFEST}")
    return manifest


def check_compatible(manifest: dict, sd: dict, topo: Topology, path: str) -> None:
    """CheckpointError unless the checkpoint holds exactly this model at this TP degree."""
    if manifest["tp"] != topo.tp:
        raise CheckpointError(
            f"checkpoint {path!r} was saved with parallel.tp={manifest['tp']}; this run has "
            f"parallel.tp={topo.tp}. Stage and DP size may change on resume, the TP degree may "
            f"not: resume with parallel.tp={manifest['tp']}")
    here = {n: list(shape) for g in sd["groups"] for n, _, _, shape in g["slots"]}
    saved = manifest["params"]
    for name, shape in here.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path!r} is from a different model: it has no "
                                  f"parameter {name!r}")
        if list(saved[name]) != shape:
            raise CheckpointError(f"checkpoint {path!r} is from a different model: {name!r} "
                                  f"has shape {tuple(saved[name])} there, {tuple(shape)} here")
    extra = sorted(set(saved) - set(here))
    if extra:
        raise CheckpointError(f"checkpoint {path!r} is from a different model: parameter "
                              f"{extra[0]!r} (and {len(extra) - 1} more) not in this model")


def load(path: str, strategy, topo: Topology, verify: bool = True, trust: bool = False,
         stateful: dict | None = None) -> dict:
    """Collective over ``topo.world``: restore ``strategy`` (any stage, any DP size) from
    checkpoint ``path`` saved at the same TP degree; returns the manifest (``step`` = the data
    position to continue from). Unless ``trust``, ``check_trusted`` first. While it loads, no
    save prunes ``path`` (a shared lock on its manifest). ``stateful``: the objects ``save``
    was given, restored in place (this rank's, or rank 0's if the world size changed)."""
    if not trust:
        files.check_trusted(path)
    with _reading(path):
        manifest = _load(path, strategy, topo, verify)
        if stateful:
            same = manifest["world_size"] == topo.world_size
            files.load_stateful(path, topo.rank if same else 0, stateful, path)
        return manifest


@contextmanager
def _reading(path: str):
    """A shared lock on ``path``'s manifest (``_prune`` skips a checkpoint so held)."""
    try:
        fd = os.open(os.path.join(path, MANIFEST), os.O_RDONLY)
    except OSError:
        yield  # read_manifest says what is wrong
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _load(path: str, strategy, topo: Topology, verify: bool) -> dict:
    manifest = read_manifest(path, verify)
    saved_states = manifest.get("states", list(STATES))
    sd = strategy.state_dict(states=saved_states)
    if sd.get("states", list(STATES)) != saved_states:
        raise CheckpointError(
            f"checkpoint {path!r} holds the optimizer states {saved_states[1:]}, this run's "
            f"optimizer {sd.get('states', list(STATES))[1:]}: resume with the optimizer it was "
            f"saved with")
    check_compatible(manifest, sd, topo, path)
    state = _state_tensors(sd, topo.tp_rank, comm.world_rank(), writer=True)
    rng_key = f"rng/rank{topo.rank}"
    same_world = manifest["world_size"] == topo.world_size
    if same_world:
        state[rng_key] = _rng_state()
    try:
        with _quiet():
            dcp = _dcp()[0]
            dcp.load(state, storage_reader=files.reader(path), planner=files.planner(),
                     **_dcp_kwargs(topo))
    # DCP wraps per-rank failures in its own type (a BaseException)
    except (Exception, _checkpoint_exception()) as e:  # noqa: BLE001
        unchecked = "" if verify else f" (loaded with verify=false; {_damaged(path, manifest)})"
        raise CheckpointError(f"checkpoint {path!r} could not be read: {files.cause(e)}"
                              f"{unchecked}") from e
    sd["step"] = manifest["opt_step"]
    if manifest["dtype"] != sd["dtype"]:
        log.warning("checkpoint %s was saved in %s, resuming in %s: fp32 master and Adam "
                    "states carry over, the loss scaler restarts", path, manifest["dtype"],
                    sd["dtype"])
    else:
        sd["scaler"] = manifest["scaler"]
    if manifest.get("optim") is not None:
        sd["optim"] = manifest["optim"]
    if same_world and not (isinstance(state[rng_key], torch.Tensor)
                           and state[rng_key].dtype == torch.uint8):
        raise CheckpointError(f"checkpoint {path!r}: {rng_key} is not a random generator state")
    strategy.load_state_dict(sd)
    if same_world:
        torch.set_rng_state(state[rng_key])
    else:  # a different world: per-rank streams cannot map 1:1; reseed deterministically
        torch.manual_seed(1_000_003 * manifest["step"] + topo.rank)
    log.info("resumed from %s: step %d (saved at stage %d dp %d, now stage %d dp %d)", path,
             manifest["step"], manifest["stage"], manifest["dp"], sd["stage"], topo.dp)
    return manifest
