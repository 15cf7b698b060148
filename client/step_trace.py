"""What :meth:`Program.from_step` traces and checks while it builds the program (client/from_step.py).

The user's functions are traced on the state's and the batch's shapes; a host source is called
once for step 0. A function that returns something else than it should fails here, naming what
is wrong.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from jax.sharding import PartitionSpec

from rallypoint.basics.errors import RallypointError
from rallypoint.client.errors import ProgramError
from rallypoint.etcd.keys import check_name

SOURCE = "batch"
"""The name of from_step's training source (its outputs are the batch's keys)."""

def trace(where: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    import jax

    try:
        return jax.eval_shape(fn, *args)
    except Exception as exc:  # user code: report it against what failed
        given = ", ".join(d if len(d := describe(a)) <= 200 else f"{d[:200]}..." for a in args)
        given = f" with {given}" if args else ""
        raise ProgramError(f"{where}: {what} failed to trace{given}: {type(exc).__name__}: {exc}") from exc


def trace_source(where: str, source: Callable[[Any, Any], Any], what: str = "source") -> Any:
    import jax
    import jax.numpy as jnp

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return trace(where, f"{what}(step, microbatch)", source, i32, i32)


def sample_host(where: str, source: Callable[[int, int], Any], what: str = "source") -> Any:
    """A host source's batch for step 0 as shapes and dtypes (JAX's: 64-bit leaves become 32-bit without
    x64, as compile warns and the runtime converts), flattened as workers flatten it."""
    from rallypoint.client.source_checks import sample_host as sample

    got: list[Any] = []

    def once(step: int, microbatch: int) -> Any:  # called once: its keys name the outputs
        if not got:
            try:
                got.append(source(step, microbatch))
            except Exception as exc:  # user code: report it against the source
                raise ProgramError(f"{where}: {what}(0, 0) failed: {type(exc).__name__}: {exc}") from exc
        return got[0]

    keys = batch_keys(where, once(0, 0), what)
    outputs = keys if keys is not None else (SOURCE,)
    avals = sample(once, outputs, f"{where}: {what}", warn=False)
    return dict(zip(outputs, avals, strict=True)) if keys is not None else avals[0]


def batch_keys(where: str, batch: Any, what: str = "source") -> tuple[str, ...] | None:
    """The batch's keys, each one output of the source; None: the batch is not a dict (one output)."""
    if not isinstance(batch, Mapping):
        return None
    if not batch:
        raise ProgramError(f"{where}: the {what} returned an empty dict; a batch needs at least one array")
    for key in batch:
        if not isinstance(key, str):
            raise ProgramError(f"{where}: the {what}'s batch has key {key!r}; batch keys must be strings")
        try:
            check_name("batch key", key)
            check_name("batch key", f"{SOURCE}.{key}")
        except RallypointError as exc:
            raise ProgramError(f"{where}: {exc} (each key of the batch is an output of the {what}; "
                               "keys of at most 57 characters)") from None
    return tuple(batch)


def batch_shardings(where: str, given: Any, batch: Any, keys: tuple[str, ...] | None, axis: str) -> dict[str, Any]:
    """PartitionSpec per source output: ``given`` (one for all, or per key) over the default."""
    import jax

    outputs = keys if keys is not None else (SOURCE,)
    values = dict(batch) if keys is not None else {SOURCE: batch}
    out = {o: PartitionSpec(axis) if all(len(a.shape) >= 1 for a in jax.tree_util.tree_leaves(values[o]))
           else PartitionSpec() for o in outputs}
    if given is None:
        return out
    if isinstance(given, PartitionSpec):
        return dict.fromkeys(outputs, given)
    if not isinstance(given, Mapping):
        raise ProgramError(f"{where}: batch_sharding must be a PartitionSpec or a dict batch key -> PartitionSpec, "
                           f"got {given!r}")
    if keys is None:
        raise ProgramError(f"{where}: batch_sharding is a dict, but the source's batch is not a dict; give one "
                           "PartitionSpec")
    for key, spec in given.items():
        if key not in out:
            raise ProgramError(f"{where}: batch_sharding names {key!r}, which is not a key of the batch {list(keys)}")
        if not isinstance(spec, PartitionSpec):
            raise ProgramError(f"{where}: batch_sharding[{key!r}] must be a PartitionSpec, got {spec!r}")
        out[key] = spec
    return out


def metric_outputs(where: str, what: str, metrics: Any, taken: set[str], prefix: str = "") -> dict[str, str]:
    """``metrics`` (a traced dict of scalars) checked: metric name (``prefix`` + key) -> a node output name."""
    if not isinstance(metrics, Mapping):
        raise ProgramError(f"{where}: {what}'s metrics must be a dict of scalars (name -> value), got "
                           f"{describe(metrics)}")
    outputs: dict[str, str] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ProgramError(f"{where}: {what}'s metrics have key {key!r}; metric names are non-empty strings")
        if getattr(value, "shape", None) != ():
            raise ProgramError(f"{where}: metric {key!r} of {what} is {describe(value)}; a metric must be a "
                               "scalar (reduce it in the step, e.g. jnp.mean)")
        outputs[prefix + key] = output_name(prefix + key, taken | set(outputs.values()))
    return outputs


def state_and_metrics(where: str, what: str, result: Any, state: Any) -> Any:
    """``result`` of a step checked as ``(new_state, metrics)`` with ``new_state`` like ``state``: the metrics."""
    if not (isinstance(result, tuple | list) and len(result) == 2):
        got = f"a {type(result).__name__} of {len(result)}" if isinstance(result, tuple | list) \
            else type(result).__name__
        raise ProgramError(f"{where}: {what} must return a pair (new_state, metrics), got {got}")
    check_same_state(where, state, result[0], what)
    return result[1]


# -- what a step asks for -------------------------------------------------------------------------------


EXTRAS = ("step", "rng")
"""What a step may ask for by keyword: the step number (an int32 scalar) and a PRNG key of the job's seed and
the step (``jax.random.fold_in(jax.random.key(seed), step)``; per microbatch, folded with it too)."""


def asks(where: str, what: str, fn: Callable[..., Any]) -> tuple[str, ...]:
    """Which of :data:`EXTRAS` ``fn`` names as parameters (a jitted function's own signature is read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable with no signature Python can read: it asks for nothing
        return ()
    got = tuple(e for e in EXTRAS if e in params
                and params[e].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
    for e in got:
        if list(params).index(e) < 2 and params[e].kind != inspect.Parameter.KEYWORD_ONLY:
            raise ProgramError(f"{where}: {what}'s parameter {e!r} comes before the state and the batch; write it "
                               f"as {what}(state, batch, *, {', '.join(got)})")
    return got


def step_key(seed: int, step: Any, microbatch: Any = None) -> Any:
    """The key a step asks for as ``rng``: of the job's seed and the step (and the microbatch)."""
    import jax

    key = jax.random.fold_in(jax.random.key(seed), step)
    return key if microbatch is None else jax.random.fold_in(key, microbatch)


def call(fn: Callable[..., Any], extras: tuple[str, ...], seed: int, args: tuple[Any, ...], step: Any,
         microbatch: Any = None) -> Any:
    """``fn(*args, step=..., rng=...)`` with the extras it asks for."""
    kw: dict[str, Any] = {}
    if "step" in extras:
        kw["step"] = step
    if "rng" in extras:
        kw["rng"] = step_key(seed, step, microbatch)
    return fn(*args, **kw)


def output_name(key: str, taken: set[str]) -> str:
    """A valid, unused node output name for metric ``key``: the key itself where it can be."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    base = (base if base[0].isalnum() else f"m{base}")[:56]
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def check_same_state(where: str, state: Any, new_state: Any, what: str = "train_step") -> None:
    import jax

    old = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(state)[0]}
    new = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(new_state)[0]}
    diff = [f"{p or 'the state'} is missing" for p in old if p not in new]
    diff += [f"{p or 'the state'} is new" for p in new if p not in old]
    diff += [f"{p or 'the state'} is {describe(new[p])}, init gives {describe(a)}" for p, a in old.items()
             if p in new and (a.shape, a.dtype) != (new[p].shape, new[p].dtype)]
    if not diff and jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(new_state):
        diff = ["its pytree types differ"]
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise ProgramError(f"{where}: {what} returns a new state unlike init()'s: {'; '.join(diff[:3])}{more}. "
                           "The next state must keep the structure, shapes and dtypes of init()")


def describe(tree: Any) -> str:
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and leaves[0] is tree and hasattr(tree, "shape"):
        return f"{tree.dtype}{list(tree.shape)}"
    if not leaves or not all(hasattr(x, "shape") for x in leaves):
        return type(tree).__name__
    return str(jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", tree))
