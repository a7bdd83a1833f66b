"""The CPU's few-row product forms (backend_gpu/layers/cpu_rows.py): each gives F.linear's
product, and the form measured for a (dtype, shape, rows) key is measured once."""

import pytest
import torch
import torch.nn.functional as F

from backend_gpu.layers import cpu_rows
from backend_gpu.layers.linear import Linear, vocab_matmul


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))  # a machine file of the test's own
    cpu_rows._saved.cache_clear()
    monkeypatch.setattr(cpu_rows, "_chosen", {})
    monkeypatch.setattr(cpu_rows, "STREAM_BYTES", 1 << 20)  # a test's timings stay short
    monkeypatch.setattr(cpu_rows, "IN_PLACE_BYTES", 0)  # and stream the test's small weights


@pytest.mark.parametrize("form", sorted(cpu_rows.FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_form_gives_linears_product(form, dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(72, 40, dtype=dtype), torch.randn(72, dtype=dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for rows in range(1, cpu_rows.MAX_ROWS + 1):
        x = torch.randn(rows, 40, dtype=dtype)
        for b in (None, bias):
            got = cpu_rows.FORMS[form](x, weight, b)
            assert got.shape == (rows, 72) and got.is_contiguous()
            torch.testing.assert_close(got, F.linear(x, weight, b), **tol)


def test_the_choice_is_measured_once_per_key(monkeypatch):
    timed = []
    time_forms = cpu_rows.time_forms
    monkeypatch.setattr(
        cpu_rows, "time_forms", lambda w, rows: timed.append(rows) or time_forms(w, rows)
    )
    torch.manual_seed(0)
    weight = torch.randn(64, 32)
    for _ in range(3):
        for rows in range(1, cpu_rows.MAX_ROWS + 1):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(cpu_rows.linear(x, weight), F.linear(x, weight))
    assert timed == list(range(1, cpu_rows.MAX_ROWS + 1))
    choices = cpu_rows.choices()
    assert set(choices.values()) <= set(cpu_rows.FORMS)
    assert choices[torch.float32, 64, 32, 4] == cpu_rows.chosen_form(weight, 4)
    assert len(timed) == cpu_rows.MAX_ROWS  # asked again: not measured again


def test_leading_dimensions_and_the_modules():
    torch.manual_seed(0)
    layer = Linear(32, 48)
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        head = torch.randn(100, 32)
        for rows in (3, cpu_rows.MAX_ROWS + 4):
            h = torch.randn(rows, 32)
            torch.testing.assert_close(vocab_matmul(h, head), F.linear(h, head))
    assert cpu_rows.choices().keys() == {(torch.float32, 48, 32, 6), (torch.float32, 100, 32, 3)}


def test_linear_elsewhere():
    """Many rows, other dtypes, and a product that autograd must see stay F.linear."""
    torch.manual_seed(0)
    weight = torch.randn(24, 16, requires_grad=True)
    for x in (
        torch.randn(cpu_rows.MAX_ROWS + 1, 16),
        torch.randn(4, 16, dtype=torch.float64),
        torch.randn(4, 16),  # grad enabled, weight requires it
    ):
        w = weight.to(x.dtype)
        assert torch.equal(cpu_rows.linear(x, w), F.linear(x, w))
    cpu_rows.linear(torch.randn(4, 16), weight).sum().backward()
    assert weight.grad is not None
    assert cpu_rows.choices() == {}


def test_a_later_process_takes_the_machines_choices(monkeypatch):
    """What one process measured, the next reads from the machine's file, untimed; an
    unreadable file is measured over and written anew."""
    torch.manual_seed(0)
    weight = torch.randn(64, 32)
    first = {rows: cpu_rows.chosen_form(weight, rows) for rows in (1, 2, 5)}

    def timed(w, rows):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_rows, "_chosen", {})  # a new process: nothing in memory
    cpu_rows._saved.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(cpu_rows, "time_forms", timed)
        assert {rows: cpu_rows.chosen_form(weight, rows) for rows in (1, 2, 5)} == first

    with open(cpu_rows.choices_path(), "w") as f:
        f.write("{not json")
    monkeypatch.setattr(cpu_rows, "_chosen", {})
    cpu_rows._saved.cache_clear()
    assert cpu_rows.chosen_form(weight, 3) in cpu_rows.FORMS
    cpu_rows._saved.cache_clear()
    assert list(cpu_rows._saved()) == ["float32 64x32 3"]


def test_a_weight_past_the_stream_is_timed_on_slices(monkeypatch):
    """An LM-head-sized weight is timed on slices of its rows, never whole: each product
    the timing makes reads at most SLICE_BYTES."""
    monkeypatch.setattr(cpu_rows, "SLICE_BYTES", 4096)
    seen = []
    forms = {
        name: (lambda x, w, b, f=f: seen.append(w.shape) or f(x, w, b))
        for name, f in cpu_rows.FORMS.items()
    }
    monkeypatch.setattr(cpu_rows, "FORMS", forms)
    weight = torch.randn(4096, 64)  # 1 MiB: past the test's STREAM_BYTES
    times = cpu_rows.time_forms(weight, 3, repeats=2)
    assert set(times) == set(forms)
    assert seen and all(shape == (16, 64) for shape in seen)
