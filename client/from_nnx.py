"""Flax NNX's own style on Rallypoint: :meth:`Program.from_nnx`.

A stateful NNX step, written as Flax's examples write it, runs unchanged::

    def create():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):   # or (model, optimizer, batch)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss                            # a scalar (reported as "loss"), a dict of metrics, or None

    program = Program.from_nnx("mlp", create=create, train_step=train_step, source=make_batch, steps=100)

The program is :meth:`Program.from_step`'s: its state is the NNX state of ``create()``'s objects as a
pure pytree (``nnx.split``; PRNG keys, such as a dropout's ``nnx.Rngs``, kept as their key data so they
checkpoint and cross the wire as plain arrays). The step's node merges the graph (``nnx.merge``, the
graph definition taken from ``nnx.eval_shape(create)``), calls the step, which mutates the objects, and
returns ``nnx.state`` of them. The batch is given as the step's parameters after the objects name it:
one parameter takes the whole batch; several take the batch's keys of their names (``x``, ``y``), or a
tuple's items in order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rallypoint.client.errors import ProgramError
from rallypoint.client.step_trace import EXTRAS, asks


def from_nnx(cls: Any, name: str, *, create: Callable[[], Any], train_step: Callable[..., Any],
             eval_step: Callable[..., Any] | None = None, **options: Any) -> Any:
    """The one-slice program of a stateful NNX ``train_step(*objects, *batch)`` (``cls``: :class:`Program`).

    Args:
        create: ``create()`` -> the NNX objects the step takes before the batch: one (a model) or a tuple
            (a model and its ``nnx.Optimizer``); called for the state at step 0.
        train_step: mutates the objects; returns a scalar (the metric ``loss``), a dict of scalar
            metrics, or None. It may ask for ``step`` and ``rng`` by keyword, as ``from_step``'s.
        eval_step: ``eval_step(*objects, *batch) -> metrics`` (a scalar is ``loss``): every
            ``eval_every`` steps on ``eval_source``, its changes to the objects dropped.
        options: :meth:`Program.from_step`'s (``source``, ``steps``, ``seed``, ``eval_source``,
            ``eval_every``, ``devices``, ...); not ``init``, ``grad_step`` or ``apply_step``.

    Raises:
        ProgramError: naming what is wrong.
    """
    where = f"Program.from_nnx {name!r}"
    for arg in ("init", "grad_step", "apply_step", "microbatches"):
        if arg in options:
            raise ProgramError(f"{where}: {arg} is not an option here (create= gives the state); use Program.from_step")
    for arg, fn in (("create", create), ("train_step", train_step)):
        if not callable(fn):
            raise ProgramError(f"{where}: {arg} must be callable, got {fn!r}")
    from flax import nnx

    try:
        shapes = nnx.eval_shape(create)
        graphdef, abstract = nnx.split(shapes)
    except Exception as exc:  # user code: report it against create
        raise ProgramError(f"{where}: create() failed to trace: {type(exc).__name__}: {exc}") from exc
    many = isinstance(shapes, tuple)

    def init() -> Any:
        return _plain(nnx.state(create()))

    def merged(state: Any) -> Any:
        return nnx.merge(graphdef, _typed(state, abstract))

    def step(state: Any, batch: Any, **extras: Any) -> Any:
        objects = merged(state)
        out = _call(train_step, objects, many, batch, extras)
        return _plain(nnx.state(objects)), _metrics(where, "train_step", out)

    def evaluate(state: Any, batch: Any, **extras: Any) -> Any:
        return _metrics(where, "eval_step", _call(eval_step, merged(state), many, batch, extras))

    wrapped = {"train_step": _like(step, asks(where, "train_step", train_step), train_step)}
    if eval_step is not None:
        if not callable(eval_step):
            raise ProgramError(f"{where}: eval_step must be callable, got {eval_step!r}")
        wrapped["eval_step"] = _like(evaluate, asks(where, "eval_step", eval_step), eval_step)
    return cls.from_step(name, init=init, **wrapped, **options)


def _like(fn: Callable[..., Any], extras: tuple[str, ...], user: Any) -> Callable[..., Any]:
    """``fn`` with the signature ``(state, batch, *, <extras>)``: from_step passes it what the user's step asks."""
    params = [inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("batch", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(e, inspect.Parameter.KEYWORD_ONLY) for e in extras]
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = getattr(user, "__name__", fn.__name__)
    return fn


def _batch_args(fn: Callable[..., Any], objects: int, batch: Any) -> tuple[Any, ...]:
    """The batch as the step's parameters after the objects take it."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in EXTRAS]
    except (TypeError, ValueError):
        return (batch,)
    rest = [p.name for p in params[objects:]]
    if len(rest) > 1 and isinstance(batch, Mapping) and all(r in batch for r in rest):
        return tuple(batch[r] for r in rest)
    if len(rest) > 1 and isinstance(batch, tuple | list) and len(batch) == len(rest):
        return tuple(batch)
    if len(rest) > 1 and isinstance(batch, Mapping):
        raise ProgramError(f"{getattr(fn, '__name__', 'the step')} takes the batch as {rest}, but the batch's keys are "
                           f"{sorted(batch)}: name the parameters after the keys, or take the batch whole")
    return (batch,)


def _call(fn: Any, objects: Any, many: bool, batch: Any, extras: Mapping[str, Any]) -> Any:
    objs = tuple(objects) if many else (objects,)
    return fn(*objs, *_batch_args(fn, len(objs), batch), **extras)


def _metrics(where: str, what: str, out: Any) -> dict[str, Any]:
    """What an NNX step returned, as from_step's metrics: None -> {}, a scalar -> {"loss": it}, a dict as it is."""
    if out is None:
        return {}
    if isinstance(out, Mapping):
        return dict(out)
    if getattr(out, "shape", None) == ():
        return {"loss": out}
    raise ProgramError(f"{where}: {what} must return a scalar loss, a dict of scalar metrics or None, got "
                       f"{type(out).__name__}{list(getattr(out, 'shape', []))}")


def _is_key(a: Any) -> bool:
    import jax

    return jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key)


def _plain(state: Any) -> Any:
    """An NNX state with its PRNG keys as their key data (uint32 arrays)."""
    import jax

    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)


def _typed(state: Any, abstract: Any) -> Any:
    """:func:`_plain` undone: the leaves that are keys in ``abstract`` wrapped as keys of their implementation."""
    import jax

    def back(x: Any, a: Any) -> Any:
        if not _is_key(a):
            return x
        impl = getattr(a.dtype, "_impl", None)  # the key's implementation (threefry by default)
        return jax.random.wrap_key_data(x, impl=impl) if impl is not None else jax.random.wrap_key_data(x)

    return jax.tree_util.tree_map(back, state, abstract)
