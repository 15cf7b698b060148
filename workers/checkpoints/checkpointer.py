"""Saving a slice's checkpoints: Orbax on disk in the background, committed in step order.

One :class:`SliceCheckpointer` per (job, slice) on a worker. ``save(step, states)``
hands Orbax the values of the slice's states after ``step`` and returns once Orbax
holds its own host copy; Orbax writes and finalizes in the background. A checkpoint
**counts only after** Orbax has finalized it (the step directory renamed from its
temporary name) and its commit (job, slice, step, path, checksum, state names) has
been handed to ``commit``, which
:func:`~rallypoint.workers.checkpoints.committer.etcd_commit` writes to etcd guarded on
the worker's incarnation. A save killed half-way therefore leaves the previous commit
in force. Commits are made by one background thread, in step order.

Orbax checks no content checksums: the commit records
:func:`~rallypoint.workers.checkpoints.checksums.state_checksum` (sha256 over every state
name, leaf dtype, shape and bytes), which a restore checks
(:mod:`rallypoint.workers.checkpoints.restore`). That checksum is of the host copy in
memory; before the commit is made (so before retention may delete the step it supersedes)
the finalized step is **verified against the bytes on disk**: its files are flushed to the
device (``fsync``), dropped from the page cache where the kernel allows it, read back with
Orbax alone and checked against the commit's checksum (``verify_on_disk``; its time is
``checkpoint.verified``'s ``verify_s``). A write corrupted on the way is then found at once,
the step does not count, and the previous commit (and its data) stays in force.

On disk each checkpointer writes its own Orbax ``CheckpointManager`` directory,
``<slice dir>/<writer>/`` (a name unique to it), so two writers of one slice (a zombie
and its successor, or a replay of a step that already counts) never share a step or
a temporary directory; each step is a plain Orbax step (item ``default``,
``StandardSave`` of ``{state name: [leaf arrays]}``): see ``docs/checkpoints.md``.
Retention deletes a step directory only after the commit naming it is gone.

Orbax is imported where it is used, not with this module: a worker (and a fresh one replacing a lost one)
starts without its import and JAX's under it, about half its start, until a job loads.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.logs import get_logger
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.keys import check_name
from rallypoint.workers import meter
from rallypoint.workers.checkpoints.checksums import binding, run_of, state_checksum
from rallypoint.workers.checkpoints.restore import States, restore_commit
from rallypoint.workers.errors import CheckpointCorrupt, CheckpointError, CommitRefused, StillCommitted

__all__ = ["SliceCheckpointer"]


@dataclass
class _Pending:
    step: int
    states: States | None
    started: float


_ORBAX_SAVES = threading.Lock()
"""Held around every ``CheckpointManager.save`` of the process. Orbax keys the signals between a save's threads
by a process-wide operation id, which each save bumps and its threads read when they are made: two managers saving
at once (the slices of one worker) took each other's ids, and one save then waited for a signal never sent (a
hang), or both wrote into one temporary directory. The lock covers only the synchronous part of a save; the
writing goes on in the background, as before."""


class SliceCheckpointer:
    """Asynchronous Orbax checkpoints of one slice's states, committed in step order.

    Args:
        slice_dir: the slice's checkpoint directory (e.g. ``<run>/<slice>``); this
            checkpointer's Orbax directory is ``slice_dir/<writer>`` (:attr:`directory`)
            and step ``s`` is written to ``slice_dir/<writer>/<s>``.
        job, slice_name: whose state this is (in commits and log events).
        max_to_keep: committed checkpoints kept on disk (None: all). Older ones are
            deleted after a newer commit, except steps held with :meth:`protect`; so are
            other writers' finalized steps that old (a step whose commit names another
            directory is kept by ``forget``).
        commit: called (on a background thread, in step order) once a checkpoint is
            finalized; it makes the checkpoint count, e.g.
            :func:`~rallypoint.workers.checkpoints.committer.etcd_commit`. An
            exception means the checkpoint does not count; :meth:`wait` raises it.
        log_fields: extra fields bound to every log event (worker, incarnation).
        forget: called with a step and its directory before retention deletes it: it deletes
            the step's commit if (and only if) that commit names this directory, and raises
            (:class:`CommitRefused`) when this writer is fenced; the directory then stays.
        writer: the name of this checkpointer's directory in ``slice_dir`` (default: a new
            unique ``w-<hex>``); it must be unique to this checkpointer.
        verify_on_disk: read each finalized step back from disk and check it against its
            checksum before it is committed (see the module doc).
        replicate: called with each commit and its states once it counts (the in-memory
            tier copies them to a peer: :mod:`rallypoint.workers.checkpoints.replicas`); must not block.
    """

    def __init__(self, slice_dir: Path, *, job: str, slice_name: str, max_to_keep: int | None,
                 commit: Callable[[CheckpointCommit], None], log_fields: Mapping[str, Any] | None = None,
                 forget: Callable[[int, str], None] | None = None,
                 replicate: Callable[[CheckpointCommit, States], None] | None = None,
                 writer: str | None = None, verify_on_disk: bool = True) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be None or at least 1, got {max_to_keep}")
        self.job, self.slice_name = check_name("job", job), check_name("slice", slice_name)
        self.writer = check_name("checkpoint writer", writer if writer is not None else f"w-{uuid.uuid4().hex[:12]}")
        self.slice_dir = Path(slice_dir).absolute()
        self.directory = self.slice_dir / self.writer
        if self.directory.exists():
            raise CheckpointError(f"checkpoint writer directory {self.directory} exists: each checkpointer of "
                                  f"{self.job}/{self.slice_name} needs a writer name of its own")
        self.max_to_keep = max_to_keep
        self._commit = commit
        self._forget = forget
        self._replicate = replicate
        self.verify_on_disk = verify_on_disk
        self.log = get_logger("rallypoint.checkpoint", job=job, slice=slice_name, writer=self.writer,
                              **(log_fields or {}))
        # Orbax's temporary-directory clean-up at start-up sees only this writer's (new, empty) directory:
        # it never touches another writer's save in flight, a zombie's included.
        self._manager = self._make_manager()
        self._orbax = threading.RLock()  # every CheckpointManager call; taken before _cond, never after
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._errors: list[BaseException] = []
        self._committed: list[int] = []
        self._protected: Counter[int] = Counter()
        self._last_step: int | None = None
        self._closing = False
        self._closed = False
        self.commits: list[CheckpointCommit] = []
        self._thread = threading.Thread(target=self._commit_loop, daemon=True,
                                        name=f"checkpoint-{job}-{slice_name}")
        self._thread.start()

    def _make_manager(self) -> Any:
        import orbax.checkpoint as ocp  # where it is used: see the module docstring
        return ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True))

    # -- saving ---------------------------------------------------------------------------

    def _host_tree(self, states: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
        """What is saved of ``states``: here host arrays (Orbax copies them before :meth:`save` returns)."""
        return {str(name): [np.asarray(x) for x in leaves] for name, leaves in states.items()}

    def _save_step(self, step: int, tree: dict[str, list[Any]]) -> None:
        """Start Orbax's save of ``tree`` as ``step``; it finalizes in the background."""
        import orbax.checkpoint as ocp  # where it is used: see the module docstring
        with _ORBAX_SAVES:
            self._manager.save(step, args=ocp.args.StandardSave(tree), force=True)

    def _checksum(self, item: _Pending) -> str:
        """The commit's checksum of a finalized save (on the commit thread)."""
        assert item.states is not None  # bound to the job, run (the directory above the slice's), slice and step
        bind = binding(self.job, run_of(self.slice_dir, self.slice_name), self.slice_name, item.step)
        return state_checksum(item.states, bind)

    def save(self, step: int, states: Mapping[str, Sequence[Any]]) -> None:
        """Start saving the slice's states after ``step`` (version ``step + 1``).

        Returns once Orbax has its host copy of every leaf; it writes and finalizes in
        the background, then the commit is made. Steps must increase. Orbax runs one
        save at a time: if the previous one is still writing, this waits for it.
        """
        if self._closing:
            raise CheckpointError(f"checkpointer of {self.job}/{self.slice_name} is closed")
        tree = self._host_tree(states)
        empty = [f"{name}[{i}]" for name, leaves in tree.items() for i, x in enumerate(leaves) if x.size == 0]
        if empty:
            # Orbax refuses zero size arrays only after it created the step's tmp directory, and
            # cleaning that up races a retry of the same step: refuse before touching the disk.
            raise CheckpointError(f"checkpoint of {self.job}/{self.slice_name} after step {step}: leaves "
                                  f"{empty} have zero size, which Orbax cannot save")
        started = time.monotonic()
        with self._orbax:
            if step < 0 or (self._last_step is not None and step <= self._last_step):
                raise CheckpointError(f"checkpoint steps of {self.job}/{self.slice_name} must increase: "
                                      f"{step} after {self._last_step}")
            # A step that exists is never replaced in place: steps increase within this writer's directory, and a
            # step saved again by a later writer (a replay) goes to that writer's directory, while the commit an
            # earlier writer made keeps naming its own until the new commit replaces it.
            try:
                self._save_step(step, tree)
            except Exception as e:
                self.log.error("checkpoint.save_failed", step=step, error=f"{type(e).__name__}: {e}")
                raise CheckpointError(f"saving {self.job}/{self.slice_name} after step {step} failed: {e}") from e
            self._last_step = step
        blocking_s = time.monotonic() - started
        meter.checkpoint_blocking(self.job, blocking_s)  # the goodput bucket checkpoint_blocking (docs/metrics.md)
        self.log.debug("checkpoint.started", step=step, blocking_s=round(blocking_s, 4))
        with self._cond:
            self._queue.append(_Pending(step, tree, started))
            self._cond.notify_all()

    @property
    def last_step(self) -> int | None:
        """The newest step whose save started (None: none yet); a later save must be of a greater step."""
        return self._last_step

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every save so far is finalized and committed (or failed).

        Raises the first error since the last call (a failed save or a refused commit).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._queue, timeout=timeout_s):
                raise CheckpointError(f"checkpoints of {self.job}/{self.slice_name} still pending "
                                      f"after {timeout_s}s: steps {[p.step for p in self._queue]}")
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Finish pending saves and commits (errors are logged, not raised), then close Orbax."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._orbax:
            self._manager.close()

    @property
    def pending_steps(self) -> list[int]:
        """Steps saved but not yet finalized and committed."""
        with self._cond:
            return [p.step for p in self._queue]

    def _commit_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                item = self._queue[0]
            try:
                self._finish(item)
                self._apply_retention()
            except Exception as e:  # noqa: BLE001 - reported through wait()
                with self._cond:
                    self._errors.append(e)
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def _finish(self, item: _Pending) -> None:
        try:
            self._manager.wait_until_finished()  # no lock: joins Orbax's finalize thread
        except Exception as e:  # noqa: BLE001 - the directory check below decides
            self.log.warning("checkpoint.finalize_error", step=item.step, error=f"{type(e).__name__}: {e}")
        path = self._finalized_path(item.step)
        if path is None:
            self.log.error("checkpoint.save_failed", step=item.step, reason="not finalized by Orbax")
            raise CheckpointError(f"Orbax did not finalize the checkpoint of {self.job}/{self.slice_name} "
                                  f"after step {item.step} in {self.directory}")
        assert item.states is not None
        nbytes = sum(int(x.nbytes) for v in item.states.values() for x in v)
        finalized = time.monotonic()
        meter.checkpoint_saved(self.job, finalized - item.started)
        self.log.info("checkpoint.saved", step=item.step, path=str(path), bytes=nbytes,
                      save_s=round(finalized - item.started, 4))
        c = CheckpointCommit(self.job, self.slice_name, item.step, str(path), self._checksum(item),
                             tuple(sorted(item.states)))
        states, item.states = item.states, None
        self._verify(c, path)
        try:
            self._commit(c)
        except Exception as e:
            self.log.error("checkpoint.commit_failed", step=c.step, error=f"{type(e).__name__}: {e}")
            raise
        meter.checkpoint_committed(self.job, time.monotonic() - finalized)
        with self._cond:
            self._committed.append(c.step)
            self.commits.append(c)
        self.log.info("checkpoint.committed", step=c.step, path=c.path, checksum=c.checksum,
                      commit_s=round(time.monotonic() - item.started, 4))
        if self._replicate is not None:  # it counts: a peer may now keep a copy in memory
            self._replicate(c, states)

    def _verify(self, c: CheckpointCommit, path: Path) -> None:
        """Check the finalized step against ``c``'s checksum from the bytes on disk (see the module doc).

        Raises:
            CheckpointError: they are not the bytes committed, or cannot be read: the step does not count.
        """
        if not self.verify_on_disk:
            return
        t0 = time.monotonic()
        try:
            settle_on_disk(path)
            restore_commit(c, self.slice_dir)
        except CheckpointCorrupt as e:
            self.log.error("checkpoint.unverified", step=c.step, path=str(path), expected=c.checksum,
                           actual=e.actual, error=str(e))
            raise CheckpointError(f"the checkpoint of {self.job}/{self.slice_name} after step {c.step} in {path} "
                                  f"is not on disk as it was saved ({e}); it does not count, the previous commit "
                                  "stays in force") from e
        self.log.info("checkpoint.verified", step=c.step, verify_s=round(time.monotonic() - t0, 4))

    def _finalized_path(self, step: int) -> Path | None:
        import orbax.checkpoint as ocp  # where it is used: see the module docstring
        for p in ocp.path.step.checkpoint_steps_paths(self.directory):
            if ocp.path.step.step_from_checkpoint_name(p.name) == step:
                return Path(str(p))
        return None

    # -- retention ------------------------------------------------------------------------

    def protect(self, step: int) -> None:
        """Never delete ``step`` until as many :meth:`release` calls (a log or a restore needs it)."""
        with self._cond:
            self._protected[step] += 1

    def release(self, step: int) -> None:
        """Drop one :meth:`protect` of ``step``; retention may then delete it."""
        with self._cond:
            if self._protected[step] <= 0:
                raise CheckpointError(f"step {step} of {self.job}/{self.slice_name} is not protected")
            self._protected[step] -= 1
            if not self._protected[step]:
                del self._protected[step]
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Delete every step older than the ``max_to_keep``-th newest commit, unless protected:
        this writer's, then other writers' finalized ones in the slice directory.

        Each goes only after ``forget`` dropped its commit (or found that the commit names
        another directory); when ``forget`` refuses (this writer is fenced), nothing more is
        deleted: a zombie never deletes what a live commit names.
        """
        if self.max_to_keep is None:
            return
        with self._orbax:
            with self._cond:
                if len(self._committed) < self.max_to_keep:
                    return
                keep_from = sorted(self._committed)[-self.max_to_keep]
                held = set(self._protected) | {p.step for p in self._queue}
            try:
                for s in [s for s in self._manager.all_steps() if s < keep_from and s not in held]:
                    if self._forget is not None:
                        self._forget(s, str(self.directory / str(s)))  # it stops counting before its data goes
                    self._manager.delete(s)
                    self.log.info("checkpoint.deleted", step=s)
                    with self._cond:
                        self._committed = [c for c in self._committed if c != s]
                for s, path in self._other_writers_steps():
                    if s >= keep_from or s in held:
                        continue
                    if self._forget is not None:
                        try:
                            self._forget(s, str(path))
                        except StillCommitted:
                            continue  # another worker's commit names it and counts: it stays
                    try:
                        shutil.rmtree(path)
                    except OSError as e:
                        self.log.warning("checkpoint.delete_failed", step=s, path=str(path), error=str(e))
                        continue
                    self.log.info("checkpoint.deleted", step=s, path=str(path))
            except CommitRefused as e:
                self.log.warning("checkpoint.retention_refused", error=str(e))

    def _other_writers_steps(self) -> list[tuple[int, Path]]:
        """Finalized steps of the slice's other writers (earlier incarnations, replays): (step, directory)."""
        out: list[tuple[int, Path]] = []
        try:
            writers = [d for d in self.slice_dir.iterdir()
                       if d.name != self.writer and not d.is_symlink() and d.is_dir()]
            for d in writers:
                out += [(int(p.name), p) for p in d.iterdir() if p.name.isdigit() and not p.is_symlink() and p.is_dir()]
        except OSError as e:
            self.log.warning("checkpoint.list_failed", path=str(self.slice_dir), error=str(e))
        return sorted(out)

    def steps_on_disk(self) -> list[int]:
        """Steps Orbax has finalized in this writer's directory."""
        import orbax.checkpoint as ocp  # where it is used: see the module docstring
        return sorted(ocp.path.step.checkpoint_steps(self.directory))

    # -- restoring ------------------------------------------------------------------------

    def restore(self, step: int, expected_checksum: str) -> States:
        """The states this checkpointer saved after ``step``, checked against the checksum.

        Raises :class:`~rallypoint.workers.errors.CheckpointCorrupt` (naming both checksums) on a mismatch or when
        the checkpoint cannot be read.
        """
        c = CheckpointCommit(self.job, self.slice_name, step, str(self.directory / str(step)), expected_checksum)
        with self._orbax:
            return restore_commit(c, self.slice_dir)


def settle_on_disk(step_dir: Path) -> None:
    """Flush every file of ``step_dir`` to the device and drop it from the page cache where the kernel allows
    (``POSIX_FADV_DONTNEED``; elsewhere a no-op), so that a read that follows reads what reached the disk."""
    for f in Path(step_dir).rglob("*"):
        if f.is_symlink() or not f.is_file():
            continue
        try:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # unreadable here: the read-back says so
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
