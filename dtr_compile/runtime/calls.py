"""Fast, per-op facts and argument flattening for the dispatch hot path.

Every aten call inside the runtime pays for these, so they avoid torch's general pytree (about 15 us a
call) and re-reading the op's schema: aten arguments are leaves or flat lists of leaves, and aten
results are a leaf or a flat tuple/list of leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_aten = torch.ops.aten

# Ops that write arguments their schema does not mark as written: (op, argument positions).
# native_batch_norm updates running_mean/running_var in place in training mode.
_UNDECLARED_WRITES: dict[Any, tuple[int, ...]] = {_aten.native_batch_norm.default: (3, 4)}
for _name in ("cudnn_batch_norm", "miopen_batch_norm"):
    if hasattr(_aten, _name):
        _UNDECLARED_WRITES[getattr(_aten, _name).default] = (3, 4)


@dataclass(frozen=True)
class OpInfo:
    name: str
    write_positions: tuple[int, ...]  # schema positions of the arguments the op writes
    argument_names: tuple[str, ...]
    random: bool  # draws from a generator: its RNG state is captured for replay
    only_views: bool  # every returned tensor aliases an argument: no fresh bytes


_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        schema = func._schema
        writes = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        writes.extend(_UNDECLARED_WRITES.get(func, ()))
        info = _INFO[func] = OpInfo(
            name=str(func),
            write_positions=tuple(writes),
            argument_names=tuple(a.name for a in schema.arguments),
            random=torch.Tag.nondeterministic_seeded in func.tags,
            only_views=all(r.alias_info is not None for r in schema.returns),
        )
    return info


# A call's layout: for each positional argument and then each keyword, -1 for a leaf or the length of
# a list (kind "l") / tuple (kind "t") whose items are leaves.
CallSpec = tuple


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], CallSpec]:
    flat: list[Any] = []
    arg_layout = []
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            arg_layout.append((len(a), t))
            flat.extend(a)
        else:
            arg_layout.append(None)
            flat.append(a)
    kw_layout = []
    for key, a in kwargs.items():
        t = type(a)
        if t is list or t is tuple:
            kw_layout.append((key, len(a), t))
            flat.extend(a)
        else:
            kw_layout.append((key, None, None))
            flat.append(a)
    return flat, (tuple(arg_layout), tuple(kw_layout))


def unflatten_call(flat: list[Any], spec: CallSpec) -> tuple[tuple, dict]:
    arg_layout, kw_layout = spec
    args = []
    i = 0
    for entry in arg_layout:
        if entry is None:
            args.append(flat[i])
            i += 1
        else:
            n, t = entry
            args.append(t(flat[i:i + n]))
            i += n
    kwargs = {}
    for key, n, t in kw_layout:
        if n is None:
            kwargs[key] = flat[i]
            i += 1
        else:
            kwargs[key] = t(flat[i:i + n])
            i += n
    return tuple(args), kwargs


def flatten_result(result: Any) -> tuple[list[Any], Any]:
    t = type(result)
    if t is tuple or t is list:
        return list(result), t
    return [result], None


def unflatten_result(flat: list[Any], spec: Any) -> Any:
    return flat[0] if spec is None else spec(flat)


def written_leaves(info: OpInfo, args: tuple, kwargs: dict, flat: list[Any]) -> list[int]:
    """Indices in `flat` of the tensors the op writes."""
    if not info.write_positions:
        return []
    ids = set()
    for pos in info.write_positions:
        arg = args[pos] if pos < len(args) else kwargs.get(info.argument_names[pos])
        if isinstance(arg, torch.Tensor):
            ids.add(id(arg))
        elif isinstance(arg, (list, tuple)):
            ids.update(id(t) for t in arg if isinstance(t, torch.Tensor))
    return [i for i, x in enumerate(flat) if id(x) in ids]
