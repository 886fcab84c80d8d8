"""A chat's images: read from their URLs, made into the vision tower's tiles, and given their places in the
prompt's token ids.

An image arrives as an OpenAI `image_url` content part: a `data:` URL (base64) always, an `http(s)` URL
only from a host the operator allows (`--allowed-image-domains`; a server that fetches any URL a client
names can be made to reach its own network). The chat template writes one `<image>` token per image; each
becomes the processor's placeholder ids (model/image_processor.py `ImageProcessor.place`), whose `<image>`
tokens the engine runs on the image's embeddings.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from model.errors import one_line
from model.image_processor import Gemma3ImageProcessor, ImageError, ImageProcessor, ProcessedImage, data_url_bytes
from model.tokenizer import Tokenizer
from server.errors import APIError

MAX_IMAGE_BYTES = 20 << 20  # an image read from a URL
FETCH_TIMEOUT_S = 10.0


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """`allowed`: host names, `*.example.com` for its subdomains, or `*` for any host."""
    host = host.lower()
    for rule in allowed:
        rule = rule.lower()
        if rule == "*" or host == rule or (rule.startswith("*.") and host.endswith(rule[1:])):
            return True
    return False


class AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL of an allowed host: else an allowed host could send the
    server to any address."""

    def __init__(self, allowed_domains: Sequence[str]) -> None:
        self.allowed_domains = allowed_domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        target = urllib.parse.urlparse(newurl)
        if target.scheme not in ("http", "https") or not host_allowed(target.hostname or "", self.allowed_domains):
            raise urllib.error.URLError(f"redirected to {target.hostname or newurl}, a host not allowed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, allowed_domains: Sequence[str]) -> bytes:
    """GET an image's bytes (blocking: run it on a worker thread); APIError 400 when it fails."""
    request = urllib.request.Request(url, headers={"User-Agent": "ladder"})
    opener = urllib.request.build_opener(AllowedRedirects(allowed_domains))
    try:
        with opener.open(request, timeout=FETCH_TIMEOUT_S) as response:  # http(s): image_bytes checked it
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise APIError(400, f"could not fetch the image at {url}: {one_line(e)}", param="messages") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(400, f"the image at {url} is larger than {MAX_IMAGE_BYTES} bytes", param="messages")
    return data


async def image_bytes(url: str, allowed_domains: Sequence[str]) -> bytes:
    if url.startswith("data:"):
        try:
            return data_url_bytes(url)
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise APIError(400, "an image URL must be a data: URL (base64) or an http(s) URL", param="messages")
    if not host_allowed(parsed.hostname, allowed_domains):
        raise APIError(400, f"images are not fetched from {parsed.hostname}: send them as data: URLs (base64), or "
                            "start the server with --allowed-image-domains naming the host", param="messages")
    return await asyncio.to_thread(fetch, url, allowed_domains)


@dataclass(frozen=True)
class ImageInputs:
    """How a server takes a chat's images, for a model that reads them."""

    processor: ImageProcessor | Gemma3ImageProcessor
    allowed_domains: tuple[str, ...] = ()
    max_images: int = 8

    async def load(self, urls: Sequence[str]) -> list[ProcessedImage]:
        """The chat's images, read and cut into tiles, in order; APIError 400 for anything unreadable."""
        if len(urls) > self.max_images:
            raise APIError(400, f"{len(urls)} images in one request; at most {self.max_images} "
                                "(--max-images-per-prompt)", param="messages")
        images = []
        for url in urls:
            data = await image_bytes(url, self.allowed_domains)
            try:
                images.append(await asyncio.to_thread(self.processor.process, data))
            except ImageError as e:
                raise APIError(400, f"image {len(images) + 1}: {e}", param="messages") from None
        return images

    def place(self, ids: list[int], images: Sequence[ProcessedImage], tokenizer: Tokenizer) -> list[int]:
        try:
            return self.processor.place(ids, images, tokenizer)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
