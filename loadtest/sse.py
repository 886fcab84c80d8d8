"""A minimal server-sent events parser: bytes in, the `data` of each complete event out."""

from __future__ import annotations


class SseParser:
    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        """Returns the data of every event completed by `chunk`; a partial event waits for the next."""
        # Normalizing the whole buffer also catches a \r\n pair split across two chunks.
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data).decode("utf-8", errors="replace"))
        return out

    @property
    def has_partial_event(self) -> bool:
        return bool(self._buffer.strip())
