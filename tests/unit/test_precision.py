"""`auto` picks bfloat16 only for generation on hardware with native kernels; an explicit
dtype is taken as asked."""

from __future__ import annotations

import pytest

from worker.precision import Hardware, serving_dtype

BARE, AMX, VNNI_BF16 = Hardware(), Hardware(amx=True), Hardware(avx512_bf16=True)


@pytest.mark.parametrize(
    ("device", "hardware", "expected"),
    [
        ("cpu", BARE, "float32"),  # emulated bfloat16 is slower than float32
        ("cpu", AMX, "bfloat16"),
        ("cpu", VNNI_BF16, "bfloat16"),
        ("cuda", BARE, "bfloat16"),
        ("cuda:1", BARE, "bfloat16"),
        ("mps", AMX, "float32"),
    ],
)
def test_auto_for_a_causal_lm_follows_the_hardware(device, hardware, expected) -> None:
    assert serving_dtype("auto", causal_lm=True, device=device, hardware=hardware) == expected


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_for_an_encoder_stays_float32_whatever_the_hardware(device) -> None:
    assert serving_dtype("auto", causal_lm=False, device=device, hardware=AMX) == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_taken_as_asked(dtype) -> None:
    for causal_lm in (True, False):
        assert serving_dtype(dtype, causal_lm=causal_lm, device="cpu", hardware=BARE) == dtype


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="int4"):
        serving_dtype("int4", causal_lm=True, device="cpu", hardware=AMX)
