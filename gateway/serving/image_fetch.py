"""An image URL fetched from a host the admin allows, without lending a client the
gateway's own reach into its network (SSRF).

A client's URL is fetched only where `allowed_image_hosts` names its host. Even then the
host could resolve to an address inside the network (a DNS record pointed at 127.0.0.1,
10.x, the cloud's 169.254.169.254), so every address it resolves to is checked and the
connection goes to a checked address, never to a second lookup that could answer
otherwise (DNS rebinding). A redirect is not followed (it could point anywhere), the
body is read only up to `max_image_bytes` and not decompressed, and the whole fetch,
lookup included, has one deadline. Every refusal is a FetchRefused whose words are the
client's 400 and name no internal address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

CHUNK = 64 * 1024
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchRefused(Exception):
    """The URL is not fetched, or its fetch failed; the message is the client's."""


def is_public(address: Address) -> bool:
    """Whether the gateway may connect to `address` for a client: a global unicast address
    (not private, loopback, link-local, shared, reserved, multicast or unspecified; an
    IPv4-mapped IPv6 address as its IPv4 address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not (address.is_multicast or address.is_reserved)


class _Pinned(AbstractResolver):
    """Resolves the one host that was checked to the addresses checked, and nothing else."""

    def __init__(self, host: str, results: list[ResolveResult]) -> None:
        self._host, self._results = host, results

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host != self._host:
            raise OSError(f"{host} was not checked")
        return self._results

    async def close(self) -> None:
        return None


async def _checked(host: str, port: int) -> list[ResolveResult]:
    """Every address `host` resolves to, each one public, or FetchRefused."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise FetchRefused(f"The image URL's host {host!r} could not be resolved.") from None
    results: list[ResolveResult] = []
    for family, _, proto, _, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if not is_public(address):
            raise FetchRefused(
                f"The image URL's host {host!r} resolves to a private, loopback or "
                "link-local address; such addresses are never fetched."
            )
        results.append(
            {
                "hostname": host,
                "host": str(address),
                "port": port,
                "family": family,
                "proto": proto,
                "flags": socket.AI_NUMERICHOST,
            }
        )
    if not results:
        raise FetchRefused(f"The image URL's host {host!r} could not be resolved.")
    return results


def _host_port(url: str, allowed: frozenset[str]) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchRefused("An image URL must be a data: URL, or http(s) from an allowed host.")
    try:
        host, port = (parts.hostname or "").rstrip("."), parts.port
    except ValueError:
        raise FetchRefused("The image URL's port is not a number.") from None
    if parts.username is not None or parts.password is not None:
        raise FetchRefused("An image URL may not carry credentials.")
    if host not in allowed:
        why = (
            "this gateway fetches no image URLs: send the image inline (a data: URL or base64)"
            if not allowed
            else "its host is not one this gateway fetches from"
        )
        raise FetchRefused(f"The image URL is not fetched: {why} (allowed_image_hosts).")
    return host, port or (443 if parts.scheme == "https" else 80)


async def fetch_image(url: str, allowed: frozenset[str], max_bytes: int, timeout_s: float) -> bytes:
    """The body of `url` (at most `max_bytes`), or FetchRefused saying why not."""
    host, port = _host_port(url, allowed)
    try:
        async with asyncio.timeout(timeout_s):
            return await _get(url, host, await _checked(host, port), max_bytes)
    except TimeoutError:
        raise FetchRefused(
            f"The image URL did not answer within {timeout_s:g} s (image_fetch_timeout_s)."
        ) from None
    except (aiohttp.ClientError, OSError):
        raise FetchRefused("The image URL could not be fetched.") from None


async def _get(url: str, host: str, addresses: list[ResolveResult], max_bytes: int) -> bytes:
    connector = aiohttp.TCPConnector(
        resolver=_Pinned(host, addresses), use_dns_cache=False, force_close=True
    )
    headers: dict[str, Any] = {"Accept": "image/*", "Accept-Encoding": "identity"}
    async with (
        aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False) as s,
        s.get(url, allow_redirects=False, headers=headers) as resp,
    ):
        if 300 <= resp.status < 400:
            raise FetchRefused("The image URL redirects; redirects are not followed.")
        if resp.status != 200:
            raise FetchRefused(f"The image URL answered HTTP {resp.status}.")
        too_big = FetchRefused(f"The image is over {max_bytes} bytes (max_image_bytes).")
        if (resp.content_length or 0) > max_bytes:
            raise too_big
        body = bytearray()
        async for chunk in resp.content.iter_chunked(CHUNK):
            body += chunk
            if len(body) > max_bytes:
                raise too_big
        return bytes(body)
