"""The rows of the linear-attention layers' state pools (model/linear_attention.py), one per running sequence.

A model with such layers (Qwen3.5) keeps a fixed-size state per sequence in place of a KV cache for them. The
scheduler gives a request a slot when it admits it and takes it back when the request finishes or is preempted
(a preempted request computes its tokens again from the first, so its state starts afresh). The engine makes as
many slots as sequences may run at once (`max_num_seqs`), so an admitted request always finds one. Pure Python.
"""

from __future__ import annotations

from engine.request import Request


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def acquire(self, request: Request) -> None:
        """Give the request a slot (it keeps the one it has)."""
        if request.state_slot >= 0:
            return
        if not self.free:  # the scheduler runs at most num_slots sequences: a slot is always free
            raise RuntimeError(f"all {self.num_slots} state slots are taken")
        request.state_slot = self.free.pop()

    def release(self, request: Request) -> None:
        if request.state_slot >= 0:
            self.free.append(request.state_slot)
            request.state_slot = -1
