"""Shared helpers of the engine tests: a value-checking executor and a harness that audits every step.

Values stand in for tensors: a storage's value is a hash of its producer's name, its inputs' values and its
position among the outputs. The executor recomputes values exactly as a real caller reruns an op, so a
recompute that ran with a missing input, or produced something else than the original, fails at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dtr_compile.engine import Engine, Operation, Storage

UNIT = 1000  # bytes of one "tensor" in the hand-built sequences


def output_values(op: Operation, input_values: Sequence[int]) -> list[int]:
    return [hash((op.name, tuple(input_values), position)) for position in range(len(op.output_refs))]


class RecordingExecutor:
    """An Executor that checks the engine's promises and records what it was asked to do.

    - `recompute(op)`: every input is resident, locked and holds its value; the budget has room for the
      outputs about to come back; the recomputed values equal the originals.
    - `evict(storage)`: never a pinned, locked, resident or constant storage.
    """

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.recomputed: list[str] = []
        self.evicted: list[str] = []  # labels of evicted storages, in order
        self.original: dict[int, int] = {}  # sid -> value at creation

    def recompute(self, op: Operation) -> None:
        engine = self.engine
        assert engine is not None
        for storage in op.inputs:
            assert storage.resident, f"recompute({op.name}) called with evicted input {storage!r}"
            assert storage.locks > 0, f"recompute({op.name}) called with unlocked input {storage!r}"
            assert storage.payload is not None, f"recompute({op.name}): input {storage!r} holds no value"
        missing = sum(s.nbytes for s in op.outputs if not s.resident and s.counted)
        if engine.budget_bytes is not None:
            assert engine.memory + missing <= engine.budget_bytes, "no room was made before a recompute"
        values = output_values(op, [s.payload for s in op.inputs])
        for ref, value in zip(op.output_refs, values):
            out = ref()
            if out is None:
                continue
            assert self.original[out.sid] == value, f"recompute of {op.name} changed the value of {out!r}"
            out.payload = value
        self.recomputed.append(op.name)

    def evict(self, storage: Storage) -> None:
        assert not storage.resident, "the engine marks a storage evicted before freeing it"
        assert not storage.pinned, f"pinned storage evicted: {storage!r}"
        assert storage.locks == 0, f"locked storage evicted: {storage!r}"
        assert storage.producer is not None, f"constant evicted: {storage!r}"
        storage.payload = None
        self.evicted.append(label(storage))


def label(storage: Storage) -> str:
    """The producer's name, with the output position for multi-output ops ("split.1")."""
    if storage.producer is None:
        return f"const#{storage.sid}"
    refs = storage.producer.output_refs
    if len(refs) == 1:
        return storage.producer.name
    position = next(i for i, ref in enumerate(refs) if ref() is storage)
    return f"{storage.producer.name}.{position}"


class Harness:
    """Drives an Engine with the caller protocol and audits the accounting after every step.

    Every storage created is kept here (strongly) so the audit can recount the resident bytes.
    """

    def __init__(self, budget: int | None, **engine_options: object) -> None:
        options: dict = {"candidate_sampling": "all", "min_evictable_fraction": 0.0, "thrash_limit": None}
        options.update(engine_options)
        self.executor = RecordingExecutor()
        self.engine = Engine(budget, executor=self.executor, **options)
        self.executor.engine = self.engine
        self.budget = budget
        self.storages: list[Storage] = []

    # ----------------------------------------------------------------------------- caller protocol
    def constant(self, nbytes: int = UNIT, *, counted: bool = True) -> Storage:
        storage = self.engine.constant(nbytes, counted=counted)
        storage.payload = hash(("constant", storage.sid))
        self._remember(storage)
        self.audit()
        return storage

    def op(
        self,
        name: str,
        inputs: Sequence[Storage],
        sizes: Sequence[int] = (UNIT,),
        cost: float = 1.0,
        *,
        consumes: Sequence[Storage] = (),
        pinned_outputs: bool = False,
        reserve_bytes: int | None = None,
    ) -> list[Storage]:
        """reserve -> "run" (compute values from the now-resident inputs) -> record. Returns the outputs."""
        engine = self.engine
        engine.reserve(inputs, sum(sizes) if reserve_bytes is None else reserve_bytes, name)
        self.audit(idle=False)
        for storage in inputs:
            assert storage.resident and storage.payload is not None, f"{name}: input {storage!r} not resident"
            assert storage.locks > 0, f"{name}: input {storage!r} not locked during the op"
        input_values = [s.payload for s in inputs]
        op = engine.record(name, inputs, sizes, cost, consumes=consumes, pinned_outputs=pinned_outputs)
        for storage in consumes:  # the new version took over the old one's memory
            storage.payload = None
        for out, value in zip(op.outputs, output_values(op, input_values)):
            out.payload = value
            self.executor.original[out.sid] = value
            self._remember(out)
        self.audit()
        return op.outputs

    def drop(self, *storages: Storage) -> None:
        for storage in storages:
            self.engine.drop_handle(storage)
            self.audit()

    def use(self, storage: Storage) -> int:
        """Materialize `storage` and return its value (which must equal the original)."""
        self.engine.materialize(storage)
        self.audit()
        assert storage.resident
        if storage.producer is not None:
            assert storage.payload == self.executor.original[storage.sid]
        return storage.payload

    # ----------------------------------------------------------------------------- invariants
    def audit(self, *, idle: bool = True) -> None:
        """`idle`: between operations, when nothing may be locked."""
        engine = self.engine
        resident = sum(s.nbytes for s in self.storages if s.resident and s.counted)
        assert engine.memory == resident, f"accounted {engine.memory} B but {resident} B are resident"
        if self.budget is not None:
            assert engine.memory <= self.budget, f"memory {engine.memory} exceeds the budget {self.budget}"
            assert engine.peak <= self.budget
        for storage in self.storages:
            if storage.pinned:
                assert storage.resident, f"pinned storage not resident: {storage!r}"
            if storage.resident:
                assert storage.payload is not None, f"resident storage lost its value: {storage!r}"
            if not storage.resident:
                assert storage.pool_index < 0, f"evicted storage still a candidate: {storage!r}"
            if idle:
                assert storage.locks == 0, f"lock leaked between operations: {storage!r}"
            if storage.handles <= 0 and storage.locks == 0 and not storage.pinned and storage.resident:
                # Freed at once, unless the engine retains dead storages (then they must stay evictable).
                assert engine.retain_needed_dead or engine.keep_dead_intermediates, (
                    f"storage without handles or locks still resident: {storage!r}"
                )
                assert storage.pool_index >= 0, f"retained dead storage is not evictable: {storage!r}"

    def _remember(self, storage: Storage) -> None:
        self.storages.append(storage)


def linear_chain_remats(n: int, heuristic: str, sampling: str | int, *, seed: int = 0) -> Engine:
    """Forward then backward through an n-layer linear feed-forward network under a budget of ~2*sqrt(n) tensors.

    Forward: a_k = f_k(a_{k-1}); every activation is saved for the backward (its handle kept). Backward:
    g_n = loss'(a_n), then b_k reads g_k and a_{k-1} and produces g_{k-1}; after b_k, the handles of g_k and
    a_{k-1} die (as autograd frees a saved tensor once its backward node has run). All ops cost 1 and every
    tensor has the same size. Returns the engine for its counters.
    """
    size = UNIT
    slots = math.ceil(2 * math.sqrt(n))
    engine = Engine(
        slots * size,
        heuristic=heuristic,
        candidate_sampling=sampling,
        min_evictable_fraction=0.0,
        thrash_limit=None,
        seed=seed,
    )
    x = engine.constant(size, counted=False)
    activations = [x]
    for k in range(1, n + 1):
        engine.reserve([activations[-1]], size, f"f{k}")
        activations.append(engine.record(f"f{k}", [activations[-1]], [size], 1.0).outputs[0])
        assert engine.memory <= engine.budget_bytes
    engine.reserve([activations[n]], size, "loss")
    grad = engine.record("loss", [activations[n]], [size], 1.0).outputs[0]
    engine.drop_handle(activations[n])
    for k in range(n, 0, -1):
        saved = activations[k - 1]
        engine.reserve([grad, saved], size, f"b{k}")
        new_grad = engine.record(f"b{k}", [grad, saved], [size], 1.0).outputs[0]
        assert engine.memory <= engine.budget_bytes
        engine.drop_handle(grad)
        if k > 1:  # a_0 is the input: it stays
            engine.drop_handle(saved)
        grad = new_grad
    return engine
