"""Admission control: the sequences the server holds at once, counted as prompts x n of every request.

One HTTP request becomes prompts x n engine sequences, so the queue limit counts sequences, not
requests. A request holds its reservation from admission (before any tokenizing) until its last
sequence ends, so requests still being tokenized count too and a burst cannot slip past the limit.
"""

from __future__ import annotations

import weakref

from server.errors import APIError


class Reservation:
    """Sequences held by one request; `release` is idempotent."""

    def __init__(self, admission: Admission, count: int) -> None:
        self.admission, self.count = admission, count
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.num_sequences -= self.count

    def release_with(self, owner: object) -> None:
        """Also release when `owner` is collected: a streaming body that is never iterated (the client
        left before the response started) runs no `finally` of its own."""
        weakref.finalize(owner, self.release)


class Admission:
    def __init__(self, max_sequences: int) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be at least 1, got {max_sequences}")
        self.max_sequences = max_sequences
        self.num_sequences = 0  # touched from the event loop only

    def reserve(self, count: int) -> Reservation:
        """Hold `count` sequences, or refuse: 400 if the request alone exceeds the limit, 429 if it does
        not fit now."""
        if count > self.max_sequences:
            raise APIError(400, f"this request asks for {count} sequences (prompts x n); the server holds at "
                                f"most {self.max_sequences} at once", param="n", code="too_many_sequences")
        if self.num_sequences + count > self.max_sequences:
            raise APIError(429, f"too many sequences in flight ({self.num_sequences} of {self.max_sequences}); "
                                "retry shortly", headers={"Retry-After": "1"})
        self.num_sequences += count
        return Reservation(self, count)
