"""Fetching the remote images a request names, when ``[server] fetch_images`` is on.

A server that fetches URLs its clients name is a server-side request forgery
(SSRF) risk: a client could make it reach addresses only the server can, such
as a router's admin page or a cloud metadata endpoint. So, per image:

- only ``http`` and ``https``, on the URL's port;
- the host is resolved first and EVERY address it resolves to must be a
  public (globally routable) one: loopback, private, link-local, multicast,
  reserved, unspecified and shared (CGNAT) addresses are refused;
- the connection goes to the checked address itself (``Host`` header and TLS
  server name keep the URL's host), so a second DNS answer cannot swap it;
- no redirects (a 3xx is refused), ``[limits] image_fetch_timeout`` seconds
  for the whole fetch, at most ``[limits] image_bytes`` read, then the bytes
  are checked as inline images are (format, header pixels).

Every refusal is a 400 naming the part. Fetches run concurrently on the event
loop (network I/O only; the pixels are decoded later on the intake thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
from typing import Any

import httpx

from mlxd.api.params import bad
from mlxd.config import Settings
from mlxd.engine import (
    ChatPrompt,
    GenerationRequest,
    ImageError,
    ImageLimits,
    ImagePart,
    image_from_bytes,
)


def refused_address(address: str) -> str | None:
    """Why ``address`` may not be fetched from, or None for a public address."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        return "a reserved address"
    if ip.is_private or not ip.is_global:
        return "a private address"
    return None


async def _resolve(host: str, port: int, where: str) -> str:
    """The address to connect to, after checking every address ``host`` resolves to."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ImageError(f"the image's host {host!r} cannot be resolved: {exc}", where) from exc
    addresses = sorted({str(info[4][0]) for info in infos})
    if not addresses:
        raise ImageError(f"the image's host {host!r} has no address", where)
    for address in addresses:
        why = refused_address(address)
        if why is not None:
            raise ImageError(
                f"mlxd does not fetch images from {host!r}: it resolves to {why} ({address})",
                where,
            )
    return addresses[0]


async def _get(url: httpx.URL, port: int, where: str, limits: ImageLimits) -> bytes:
    """The body at ``url``, from the checked address, within the size limit."""
    address = await _resolve(url.host, port, where)
    pinned = url.copy_with(host=address)
    headers = {"Host": url.netloc.decode("ascii"), "Accept": "image/*"}
    extensions: dict[str, Any] = {"sni_hostname": url.host}
    async with (
        httpx.AsyncClient(follow_redirects=False, trust_env=False) as client,
        client.stream("GET", pinned, headers=headers, extensions=extensions) as r,
    ):
        if r.is_redirect:
            raise ImageError("the image URL redirects; mlxd does not follow redirects", where)
        if r.status_code != 200:
            raise ImageError(f"fetching the image answered {r.status_code}", where)
        data = bytearray()
        async for chunk in r.aiter_bytes():
            data.extend(chunk)
            if len(data) > limits.max_bytes:
                raise ImageError(
                    f"the image is more than {limits.max_bytes:,} bytes ([limits] image_bytes)",
                    where,
                )
    return bytes(data)


async def fetch_one(part: ImagePart, limits: ImageLimits, timeout: float) -> ImagePart:
    """``part``'s URL fetched and checked as an inline image would be.

    Raises:
        ImageError: the URL, its address, the answer or the image is refused.
    """
    assert part.url is not None
    where = part.where
    try:
        url = httpx.URL(part.url)
    except Exception as exc:  # httpx.InvalidURL and friends
        raise ImageError(f"the image URL is not valid: {exc}", where) from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ImageError("an image URL must be http(s)://host/...", where)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        data = await asyncio.wait_for(_get(url, port, where, limits), timeout)
    except (TimeoutError, asyncio.TimeoutError) as exc:  # one class from Python 3.11
        raise ImageError(
            f"fetching the image took more than {timeout:g} s ([limits] image_fetch_timeout)",
            where,
        ) from exc
    except httpx.HTTPError as exc:
        raise ImageError(f"the image cannot be fetched: {exc}", where) from exc
    return image_from_bytes(data, None, where, limits)


async def fetch_images(gen: GenerationRequest, settings: Settings) -> GenerationRequest:
    """``gen`` with its remote images fetched (unchanged when it has none).

    Raises:
        OpenAIError: a 400 ``invalid_image`` naming the first refused part.
    """
    prompt = gen.prompt
    if not isinstance(prompt, ChatPrompt) or not any(p.url for p in prompt.images):
        return gen
    limits = settings.limits
    image_limits = ImageLimits(
        int(limits.image_bytes),
        limits.image_pixels,
        limits.max_images,
        limits.image_aspect_ratio,
    )
    timeout = limits.image_fetch_timeout

    async def one(part: ImagePart) -> ImagePart:
        return await fetch_one(part, image_limits, timeout) if part.url else part

    try:
        images = await asyncio.gather(*(one(p) for p in prompt.images))
    except ImageError as exc:
        raise bad(exc.param, f"{exc.param}: {exc}", code="invalid_image") from exc
    return dataclasses.replace(gen, prompt=dataclasses.replace(prompt, images=tuple(images)))
