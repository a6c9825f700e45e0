"""format_bytes: adaptive binary units with three significant figures, whole bytes below 1 KiB."""

import subprocess
import sys

import pytest

from sublinear.core.units import format_bytes


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1, "1 B"), (512, "512 B"), (1023, "1023 B"),
    (1024, "1.00 KiB"), (3277, "3.20 KiB"), (10_234, "9.99 KiB"), (102_300, "99.9 KiB"), (1_048_000, "1023 KiB"),
    (24 * 2**20, "24.0 MiB"), (117 * 2**20, "117 MiB"), (3 * 2**30 // 2, "1.50 GiB"), (11 * 2**30, "11.0 GiB"),
    (5 * 2**40, "5.00 TiB"), (2**50, "1024 TiB"),
])
def test_three_significant_figures_in_the_largest_unit_that_keeps_the_number_at_least_one(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n,text", [(1023.6, "1.00 KiB"), (2**20 - 1, "1.00 MiB"), (9.996 * 2**20, "10.0 MiB"),
                                    (99.96 * 2**20, "100 MiB")])
def test_rounding_up_moves_to_the_next_unit_or_drops_a_decimal(n, text):
    assert format_bytes(n) == text


def test_small_sizes_never_read_as_zero_and_negative_differences_keep_their_sign():
    assert format_bytes(1) == "1 B" and format_bytes(700.4) == "700 B"
    assert format_bytes(-2048) == "-2.00 KiB"


def test_units_import_without_torch():
    code = "import sys, sublinear.core.units; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
