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
from model.vision import per_image


class ImageCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def start(self, images: Sequence[ProcessedImage], encode_tiles: Callable[[torch.Tensor], torch.Tensor],
              tokens_per_tile: int) -> ImageEncoding:
        """The encoding of a prompt's images: those the cache holds are found now, the rest run through
        `encode_tiles` (tiles [N, 3, S, S] -> [N * tokens_per_tile, hidden]) as the encoding advances."""
        return ImageEncoding(self, images, encode_tiles, tokens_per_tile)

    def _put(self, digest: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes:
            return
        self.entries[digest] = embeds
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()


class ImageEncoding:
    """One prompt's images on their way through the tower a few tiles at a time, so the engine can run its
    other requests' steps between the pieces (a tile is a few hundred ms of a 2-core CPU's time; an image up
    to 17 tiles). Tiles are independent in the tower (each attends within itself), so any split gives the
    embeddings one run over all of them would."""

    def __init__(self, cache: ImageCache, images: Sequence[ProcessedImage],
                 encode_tiles: Callable[[torch.Tensor], torch.Tensor], tokens_per_tile: int) -> None:
        self.cache, self.images = cache, list(images)
        self.encode_tiles, self.tokens_per_tile = encode_tiles, tokens_per_tile
        # The images the cache lacks, each once (an image twice in one prompt is encoded once).
        self.missing = {image.digest: image for image in images if image.digest not in cache.entries}
        cache.hits += len(images) - len(self.missing)
        cache.misses += len(self.missing)
        self.tiles = torch.cat([image.pixels for image in self.missing.values()]) if self.missing else None
        self.next_tile = 0
        self.outputs: list[torch.Tensor] = []

    @property
    def num_tiles(self) -> int:
        """Tiles to run: those of the images the cache lacks."""
        return 0 if self.tiles is None else self.tiles.shape[0]

    @property
    def done(self) -> bool:
        return self.next_tile == self.num_tiles

    def advance(self, max_tiles: int) -> None:
        """Run the tower over up to `max_tiles` more tiles."""
        if not self.done:
            piece = self.tiles[self.next_tile:self.next_tile + max_tiles]
            self.outputs.append(self.encode_tiles(piece))
            self.next_tile += piece.shape[0]

    def result(self) -> list[torch.Tensor]:
        """Each image's embeddings, in order, once `done`; the new ones join the cache."""
        fresh: dict[bytes, torch.Tensor] = {}
        if self.missing:
            embeds = per_image(torch.cat(self.outputs), list(self.missing.values()), self.tokens_per_tile)
            fresh = dict(zip(self.missing, embeds, strict=True))
        out = []
        for image in self.images:
            found = self.cache.entries.get(image.digest)
            if found is not None:
                self.cache.entries.move_to_end(image.digest)
            out.append(found if found is not None else fresh[image.digest])
        for digest, embeds in fresh.items():
            self.cache._put(digest, embeds)
        return out
