"""Issue 52's worker wire for images: what one image costs between a gateway and a kvgate
worker as the client's file (engine_api.images' wire form since 0af392f) against its
RGB pixels in base64 (the form before it, rebuilt here as the peer), in one run: bytes
on the wire, the sender's CPU (the record written as JSON) and the receiver's (the JSON
read and the digest checked: for the file, after decoding it as the gateway did; for
the pixels, after their base64); and the body limit a worker needs for each form at the
default image settings.

The pictures are vision_cache's drawn scenes (sky, sun, hills, a house, noise, a blur:
photo-like for a codec), saved as JPEG (quality 90) and PNG. The forms alternate within
each round, so a shared machine's noise falls on both; medians of `--rounds`.

    .venv/bin/python -m studies.image_wire --rounds 15
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time
from collections.abc import Callable

from PIL import Image

from bench.options import DefaultsHelpFormatter
from engine_api.images import ImageInput, image_digest
from gateway.backends.remote_images import IMAGE_RECORD_BYTES
from gateway.config import Settings
from gateway.serving.images import decode_image
from gateway.worker.app import worker_body_bytes
from studies.vision_cache import picture

MAX_PIXELS = Settings().max_image_pixels


def encoded(size: int, kind: str) -> ImageInput:
    """The scene as the gateway holds it after decoding the client's `kind` file."""
    drawn = picture(size, seed=size)
    out = io.BytesIO()
    image = Image.frombytes("RGB", (size, size), drawn.rgb)
    image.save(out, kind, **({"quality": 90} if kind == "JPEG" else {}))
    return decode_image(out.getvalue(), MAX_PIXELS)


def file_form(image: ImageInput) -> tuple[str, Callable[[str], None]]:
    def receive(body: str) -> None:
        sent = ImageInput.from_dict(json.loads(body))
        assert decode_image(sent.data, MAX_PIXELS).digest == sent.digest

    return json.dumps(image.to_dict()), receive


def pixel_form(image: ImageInput) -> tuple[str, Callable[[str], None]]:
    def receive(body: str) -> None:
        sent = json.loads(body)
        rgb = base64.b64decode(sent["rgb"], validate=True)
        assert image_digest(sent["width"], sent["height"], rgb) == sent["digest"]

    record = {"digest": image.digest, "width": image.width, "height": image.height}
    return json.dumps(record | {"rgb": base64.b64encode(image.rgb).decode()}), receive


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(image: ImageInput, rounds: int) -> dict:
    forms = {"file": file_form, "pixels": pixel_form}
    sent: dict[str, list[float]] = {f: [] for f in forms}
    read: dict[str, list[float]] = {f: [] for f in forms}
    size = {}
    for _ in range(rounds):
        for name, form in forms.items():  # alternating: both see the same machine
            body, receive = form(image)
            sent[name].append(timed(lambda form=form: form(image)))
            read[name].append(timed(lambda body=body, receive=receive: receive(body)))
            size[name] = len(body)
    ms = {
        f"{k}_{f}_ms": statistics.median(v[f]) * 1000
        for k, v in (("send", sent), ("read", read))
        for f in forms
    }
    return {
        "bytes_file": size["file"],
        "bytes_pixels": size["pixels"],
        "bytes_pixels_over_file": size["pixels"] / size["file"],
        **{k: round(v, 2) for k, v in ms.items()},
        "send_pixels_over_file": ms["send_pixels_ms"] / ms["send_file_ms"],
        "read_pixels_over_file": ms["read_pixels_ms"] / ms["read_file_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    args = parser.parse_args()
    for size in args.sizes:
        for kind in ("JPEG", "PNG"):
            row = {"image": f"{size}x{size} {kind}"} | measure(encoded(size, kind), args.rounds)
            print(
                json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            )
    s = Settings()
    before = s.max_body_bytes + s.max_images_per_request * (4 * MAX_PIXELS + IMAGE_RECORD_BYTES)
    after = worker_body_bytes(s)
    limits = {"body_limit_pixels_mib": before / 2**20, "body_limit_files_mib": after / 2**20}
    print(
        json.dumps(
            {k: round(v, 1) for k, v in limits.items()} | {"ratio": round(before / after, 2)}
        )
    )


if __name__ == "__main__":
    main()
