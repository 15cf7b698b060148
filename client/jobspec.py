"""A compiled program as the ``JobSpec`` message the coordinator receives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rallypoint.basics.settings import SETTINGS_FILE, encode as encode_settings
from rallypoint.client.bundle import IGNORE_FILE, bundle_files, pack, relative_to_bundle
from rallypoint.client.compile import CompiledProgram
from rallypoint.client.program import Gathered, ProgramError, Ref, StateRef
from rallypoint.client.trees import skeleton
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import structure
from rallypoint.recovery.spikes import SPIKE_FIELDS
from rallypoint.workers.checkpoints.pretrained import encode_keys


RECOVERY_FIELDS = ("policy", "on_no_spare", "wait_timeout_s", "checkpoint_every", "checkpoint_dir", "keep_checkpoints",
                   "log_limit_bytes", "stall_timeout_s", "priority", "stragglers", "straggler_factor",
                   "straggler_window", "straggler_persist", "straggler_probation_s", "straggler_repeat_window_s",
                   "warm_spares", "max_faults", "max_preemptions", "failure_window_s", "compile_timeout_s",
                   "on_nonfinite", *SPIKE_FIELDS)


def job_spec(compiled: CompiledProgram, *, window: int = 0, code_dir: str | Path | None = None,
             tensorboard: str | Path | None = None, wandb: str | Path | None = None, **recovery: Any) -> pb.JobSpec:
    """Everything the runtime needs to run ``compiled``: slices, exported nodes and inits, and the
    job's code bundle when it has host sources (or ``code_dir`` is given).

    ``window``: steps the workers may run ahead of the leader; 0 (the default): the leader decides it from
    the checkpoint interval and the output log's limit (docs/runtime.md, "The window").

    ``code_dir``: the directory shipped as the code bundle (default: the directory of the job
    file that declares the first host source; docs/data.md). The bundle also ships the program's
    ``settings`` (docs/data.md, "Job settings").
    ``tensorboard``, ``wandb``: directories the leading coordinator writes the job's metrics and marks
    to (``DIR/<job>/<run id>/``; docs/metrics.md, "Trackers"); checked writable here.
    ``recovery``: any of :data:`RECOVERY_FIELDS` (``JobSpec`` fields; None: the
    default; ``checkpoint_every`` defaults to the program's).

    Raises:
        ProgramError: a bad setting, a bundle over its limit, a host source outside the bundle.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ProgramError(f"the window of steps in flight must be an int >= 1, or 0 for the leader to decide it "
                           f"from the checkpoint interval and the output log's limit (the default), got {window!r}")
    unknown = sorted(set(recovery) - set(RECOVERY_FIELDS))
    if unknown:
        raise ProgramError(f"unknown recovery settings {unknown}; known: {list(RECOVERY_FIELDS)}")
    warm = recovery.get("warm_spares")
    if warm is not None and (isinstance(warm, bool) or not isinstance(warm, int) or warm < 0):
        raise ProgramError(f"warm_spares must be an int >= 0 (0: no warm spares; None: the default), got {warm!r}")
    program = compiled.program
    metric_names: dict[tuple[str, str], list[str]] = {}
    for name, ref in program.metrics.items():
        metric_names.setdefault((ref.node, ref.output), []).append(name)
    spec = pb.JobSpec(job=program.name, steps=program.steps, microbatches=program.microbatches, window=window,
                      checkpoint_every=program.checkpoint_every)
    for key, value in recovery.items():
        if value is not None:
            setattr(spec, key, value)
    for kind, where in (("tensorboard", tensorboard), ("wandb", wandb)):
        if where is not None:
            spec.metrics_sinks.append(pb.MetricsSink(kind=kind, dir=str(writable_dir(where, f"--{kind}"))))
    for s in program.slices.values():
        spec.slices.append(pb.SliceAssignment(slice=s.name, mesh_shape=s.mesh_shape, mesh_axes=s.mesh_axes))
    for st in compiled.states.values():
        producer = st.producer[0] if st.producer else ""
        spec.states.append(pb.StateProgram(
            name=st.name, slice=st.slice, exported_init=st.exported_init, leaves=st.tree.num_leaves,
            producer_node=producer, producer_every=program.nodes[producer].every if producer else 0,
            treedef=structure(st.tree), tree=skeleton(st.tree), init_variants=_variants(program, st.slice, st.variants),
            platforms=st.platforms, init_from=_init_from(st.init_from),
        ))
    hosts = [compiled.nodes[n] for n in compiled.order if compiled.nodes[n].host is not None]
    bundle = None
    if hosts or code_dir is not None:
        extra = {SETTINGS_FILE: encode_settings(program.settings)} if program.settings else None
        bundle = pack(code_dir if code_dir is not None else Path(hosts[0].host[0]).parent,  # type: ignore[index]
                      extra=extra)
        spec.code.CopyFrom(pb.CodeBundle(sha256=bundle.sha256, zip=bundle.zip, size=len(bundle.zip),
                                         files=bundle.files))
    for name in compiled.order:
        node = compiled.nodes[name]
        msg = pb.NodeProgram(name=name, slice=node.slice, per_microbatch=node.per == "microbatch", every=node.every,
                             exported=node.exported, variants=_variants(program, node.slice, node.variants),
                             platforms=node.platforms, clock=node.clock)
        if node.host is not None:
            assert bundle is not None
            what = f"host source {name!r} ({node.host[1]})"
            rel = relative_to_bundle(bundle.root, node.host[0], what)
            if rel not in {r for r, _ in bundle_files(bundle.root)}:
                raise ProgramError(f"{what}: its file {rel} is left out of the code bundle of {bundle.root} "
                                   f"({IGNORE_FILE} or the default ignores); the worker could not import it")
            msg.host_source.CopyFrom(pb.HostSource(file=rel, name=node.host[1], prefetch=node.prefetch))
        for arg, tree in zip(node.input_names, node.in_trees, strict=True):
            b = pb.InputBinding(arg=arg, leaves=tree.num_leaves)
            if node.is_source:
                b.kind = pb.InputBinding.STEP if arg == "step" else pb.InputBinding.MICROBATCH
            else:
                src = node.inputs[arg]
                if isinstance(src, StateRef):
                    b.kind, b.state = pb.InputBinding.STATE, src.name
                else:
                    ref: Ref = src.ref if isinstance(src, Gathered) else src
                    b.kind = pb.InputBinding.GATHER if isinstance(src, Gathered) else pb.InputBinding.REF
                    b.node, b.output = ref.node, ref.output
                    b.producer_per_microbatch = compiled.nodes[ref.node].per == "microbatch"
            msg.inputs.append(b)
        for out, tree in zip(node.outputs, node.out_trees, strict=True):
            msg.outputs.append(pb.OutputSpec(name=out, leaves=tree.num_leaves, updates_state=node.updates.get(out, ""),
                                             metrics=metric_names.get((name, out), [])))
        spec.nodes.append(msg)
    return spec


def _init_from(init_from: Any) -> pb.InitFrom | None:
    """A state's pretrained start as it crosses the wire (None: it starts from its init)."""
    if init_from is None:
        return None
    return pb.InitFrom(path=init_from.path, keys=encode_keys(init_from.keys), checksum=init_from.checksum)


def writable_dir(where: str | Path, option: str) -> Path:
    """``where`` made absolute, created if needed and checked writable (a file made and removed there).

    Raises:
        ProgramError: it cannot be made or written, naming it and what to do.
    """
    import os
    import tempfile

    path = Path(where).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rallypoint-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ProgramError(f"{option} {where}: cannot write there ({exc.strerror or exc}): give a directory you "
                           "can write (made if missing), on the coordinators' filesystem") from None
    return path


def _variants(program: Any, slice_name: str, variants: dict[int, bytes]) -> list[pb.ExportedVariant]:
    spec = program.slices[slice_name]
    return [pb.ExportedVariant(devices=c, mesh_shape=spec.mesh_shape_for(c), exported=blob)
            for c, blob in sorted(variants.items(), reverse=True)]
