"""How micro-batches reach the user's loop and its model: ampdoctor's own feed around
`micro_batches`, the index that names the micro-batch a forward reads (by tensor storage), and
the forward hooks that align the RNG per micro-batch (`dropout: align`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from ..maths import rng


class FetchListener(Protocol):
    """Told which micro-batch the loop takes (the probe)."""

    def on_microbatch(self, index: int) -> None: ...


#: At most this many containers are walked in one forward's arguments (a forward handed a
#: huge list, or a structure that contains itself, costs nothing more).
MAX_CONTAINERS = 10_000


def storages(value: Any) -> Iterator[int]:
    """The storage addresses of the tensors in a (nested) micro-batch or forward argument, in
    order. Iterative: no recursion (a loop may have lowered the recursion limit, and these run
    inside its forwards), each container walked once (one that holds itself ends)."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                yield item.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):   # meta / sparse / nested tensors
                continue
        elif isinstance(item, (dict, list, tuple)):
            if id(item) in seen or len(seen) >= MAX_CONTAINERS:
                continue
            seen.add(id(item))
            children = list(item.values()) if isinstance(item, dict) else list(item)
            stack.extend(reversed(children))


class MicroBatchIndex:
    """Which micro-batch a tensor belongs to, by its storage: every micro-batch ampdoctor hands
    out owns its storage, and what a loop does on the way to the model (`.to(device)` on the
    same device, slicing `x[:, :-1]`, `batch["input_ids"]`) keeps it."""

    def __init__(self, micro_batches: list[Any], indices: list[int] | None = None):
        self._by_storage: dict[int, int] = {}
        for index, mb in zip(indices or range(len(micro_batches)), micro_batches, strict=False):
            for ptr in storages(mb):
                if ptr:
                    self._by_storage.setdefault(ptr, index)

    def find(self, args: Any, kwargs: Any) -> int | None:
        for ptr in storages((args, kwargs)):
            index = self._by_storage.get(ptr)
            if index is not None:
                return index
        return None


#: Top-level model forwards run so far in this process, by who ran them: "loop" (the user's
#: loop under the probe, references run as the loop included) or "reference" (the reference
#: model on the spec's `loss`). The ladder reports them per rung when AMPDOCTOR_COUNT_PASSES is
#: set (bench/); each forward is followed by its backward in every run ampdoctor makes.
FORWARDS: dict[str, int] = {"loop": 0, "reference": 0}


class ForwardAligner:
    """Forward hooks on a model: name the micro-batch each top-level forward consumes and, with
    `seed` set, run that forward under a fixed RNG state per micro-batch (dropout masks then
    match between the loop's runs and the reference) without touching the RNG stream outside
    the forward (randomness elsewhere still shows in the reproducibility rung)."""

    def __init__(self, index: MicroBatchIndex, seed: int | None,
                 on_forward: Callable[[int | None], None] | None = None):
        self.index = index
        self.seed = seed
        self.on_forward = on_forward
        self._forks: list[Any] = []
        self._handles: list[Any] = []
        self.depth = 0   # inside a top-level forward
        #: the micro-batch to seed by when a forward matches none (the one last fetched)
        self.fallback: Callable[[], int | None] | None = None

    def attach(self, model: torch.nn.Module) -> ForwardAligner:
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> None:
        index = self.index.find(args, kwargs)
        if self.depth == 0:
            FORWARDS["loop" if self.on_forward is not None else "reference"] += 1
        if self.on_forward is not None:
            self.on_forward(index)
        key = index if index is not None else (self.fallback() if self.fallback else None)
        fork = None
        if self.seed is not None and key is not None:
            devices = ([torch.cuda.current_device()] if torch.cuda.is_available()
                       and torch.cuda.is_initialized() else [])
            fork = torch.random.fork_rng(devices=devices)
            fork.__enter__()
            rng.manual_seed(self.seed * 1_000_003 + key)
        self._forks.append(fork)
        self.depth += 1
        return None

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        fork = self._forks.pop() if self._forks else None
        if fork is not None:
            fork.__exit__(None, None, None)
        return None


class MicroBatchFeed(Sequence):
    """ampdoctor's own iterable around the micro-batches: records which one is handed out."""

    def __init__(self, micro_batches: list[Any], probe: FetchListener,
                 indices: list[int] | None = None):
        self._items = list(micro_batches)
        self._probe = probe
        #: the session-wide index of each item (a reference run feeds one window's micro-batches)
        self._indices = list(indices) if indices is not None else list(range(len(self._items)))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._items)))]
        if index < 0:
            index += len(self._items)
        self._probe.on_microbatch(self._indices[index])
        return self._items[index]

    def __iter__(self) -> Iterator[Any]:
        for index, item in enumerate(self._items):
            self._probe.on_microbatch(self._indices[index])
            yield item
