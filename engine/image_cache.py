"""The vision tower's outputs by image, kept so a conversation that sends the same image again (every turn
of a chat about a picture does) skips the tower, which is most of such a turn's time to the first token.

Keyed by the image's digest (a sha256 of its decoded pixels, model/image_processor.py): the tiles, and so
the embeddings, are a function of the pixels and the model's processor. Least recently used first out, within
a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from model.image_processor import ProcessedImage


class ImageCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def embeddings(self, images: Sequence[ProcessedImage],
                   encode: Callable[[Sequence[ProcessedImage]], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings, in order: from the cache, or from one `encode` call over the images it
        lacks (an image twice in one request is encoded once)."""
        missing = {image.digest: image for image in images if image.digest not in self.entries}
        self.hits += len(images) - len(missing)
        self.misses += len(missing)
        fresh = dict(zip(missing, encode(list(missing.values())), strict=True)) if missing else {}
        out = []
        for image in images:
            found = self.entries.get(image.digest)
            if found is not None:
                self.entries.move_to_end(image.digest)
            out.append(found if found is not None else fresh[image.digest])
        for digest, embeds in fresh.items():
            self._put(digest, embeds)
        return out

    def _put(self, digest: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes:
            return
        self.entries[digest] = embeds
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
