"""The owner of the LoRA slots: which adapters are known, which are resident, and which rows use them.

Known adapters are held in host memory as read (model/lora.py); at most `max_loras` are resident in the
model's slots (model/lora_slots.py). A request takes a slot when the scheduler admits it (`acquire`,
which loads the adapter into a free slot, or into the least recently used slot no running request holds)
and gives it back when it finishes or is preempted (`release`). A request whose adapter finds no slot
waits; requests behind it whose adapters are resident go first. Pure Python apart from the copy into
the slots: unit-tested with a fake slot holder.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Protocol

from model.lora import LoRAAdapter


class SlotHolder(Protocol):
    max_loras: int
    max_rank: int

    def load(self, slot: int, adapter: LoRAAdapter) -> None: ...

    def clear(self, slot: int) -> None: ...


class LoRAInUseError(ValueError):
    """An adapter that unfinished requests still use cannot be removed."""


class LoRAManager:
    def __init__(self, slots: SlotHolder) -> None:
        self.slots = slots
        self.adapters: dict[str, LoRAAdapter] = {}
        self.ids: dict[str, int] = {}  # a number per registration: a name loaded again is another adapter
        self._next_id = itertools.count(1)
        self.slot_of: dict[str, int] = {}  # resident adapters
        self.resident: list[str | None] = [None] * slots.max_loras
        self.pins = [0] * slots.max_loras  # running requests holding each slot
        self.last_used: OrderedDict[int, None] = OrderedDict.fromkeys(range(slots.max_loras))  # oldest first
        self.num_loads = 0  # copies into a slot since start

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if adapter.rank > self.slots.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank "
                             f"{self.slots.max_rank}")
        self.adapters[adapter.name] = adapter
        self.ids[adapter.name] = next(self._next_id)

    def remove(self, name: str) -> None:
        """Forget an adapter no request holds (the engine checks its queue first)."""
        if name not in self.adapters:
            raise KeyError(name)
        slot = self.slot_of.get(name)
        if slot is not None:
            if self.pins[slot]:
                raise LoRAInUseError(f"LoRA adapter {name!r} is in use by {self.pins[slot]} running requests")
            del self.slot_of[name]
            self.resident[slot] = None
            self.slots.clear(slot)
        del self.adapters[name], self.ids[name]

    def cache_salt(self, name: str) -> bytes:
        """What the prefix cache's hash chain starts from for this adapter's requests: its cached blocks
        are never another adapter's (or the base model's), nor those of an earlier adapter of this name."""
        return f"lora:{self.ids[name]}".encode()

    def acquire(self, name: str) -> int | None:
        """A slot holding the adapter, pinned for one request; None when every slot is pinned by others."""
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            old = self.resident[slot]
            if old is not None:
                del self.slot_of[old]
            self.slots.load(slot, self.adapters[name])
            self.num_loads += 1
            self.resident[slot], self.slot_of[name] = name, slot
        self.pins[slot] += 1
        self.last_used.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.pins[slot] -= 1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one that no running request holds."""
        for slot, name in enumerate(self.resident):
            if name is None:
                return slot
        return next((slot for slot in self.last_used if self.pins[slot] == 0), None)
