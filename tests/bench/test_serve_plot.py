"""`kvgate bench serve --plot` against a real `kvgate serve --backend fake` process: the
PNG draws completed requests in the plot's series colours and failed ones in red."""

import numpy as np
import pytest
from matplotlib import colors, image

from bench.cli import main
from tests.conftest import start_gateway

LATENCY, TTFT, FAILED = (colors.to_rgb(c) for c in ("C0", "C1", "red"))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("gateway"), "--backend", "fake")
    try:
        yield gw.url, gw.tenant_key("plot")[1]
    finally:
        gw.stop()


def has_colour(pixels: np.ndarray, rgb: tuple[float, float, float]) -> bool:
    return bool(np.any(np.all(np.abs(pixels[..., :3] - rgb) < 0.02, axis=-1)))


@pytest.mark.parametrize("good_key", [True, False])
def test_serve_plot(gateway, tmp_path, capsys, good_key):
    url, key = gateway
    png = tmp_path / "serve.png"
    api_key = key if good_key else "sk-wrong"
    argv = ["serve", "--url", url, "--api-key", api_key, "--model", "fake-model"]
    argv += ["--num-prompts", "10", "--input-len", "8", "--output-len", "4", "--ignore-eos"]
    argv += ["--request-rate", "100", "--plot", str(png), "--no-progress"]
    rc = main(argv)
    assert rc == (0 if good_key else 1)
    assert f"saved {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(png)
    assert pixels.shape[:2] == (462, 990)  # 9 x 4.2 inches at 110 dpi
    assert has_colour(pixels, LATENCY) == has_colour(pixels, TTFT) == good_key
    assert has_colour(pixels, FAILED) != good_key
