import pytest

from helpers.core.units import GiB, KiB, MiB, format_bytes, parse_bytes, percent


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (KiB, "1.00 KiB"), (118 * MiB, "118.00 MiB"),
     (int(1.5 * GiB), "1.50 GiB"), (int(39.56 * GiB), "39.56 GiB"), (-2 * MiB, "-2.00 MiB"), (None, "n/a")],
)  # fmt: skip
def test_format_bytes_uses_binary_units_like_pytorch(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "text, n",
    [("118.00 MiB", 118 * MiB), ("1.23 GiB", round(1.23 * GiB)), ("512 bytes", 512), ("2GB", 2 * GiB),
     ("34.88 MiB", round(34.88 * MiB)), ("7", 7), ("1 KiB", 1024)],
)  # fmt: skip
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_format_parse_round_trip():
    for n in (1, 1000, 5 * MiB + 17, 14 * GiB + 123456):
        assert abs(parse_bytes(format_bytes(n, precision=6)) - n) <= max(1, n * 1e-6)


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "GiB"])
def test_parse_bytes_rejects_non_sizes_with_the_valid_units(bad):
    with pytest.raises(ValueError, match="GiB"):
        parse_bytes(bad)


def test_percent_unknown_is_none():
    assert percent(None, 10) is None and percent(1, 0) is None and percent(1, 4) == 25.0


def test_wrong_types_say_which_function_to_use():
    import numpy as np
    import pytest

    from helpers.core.units import format_bytes, parse_bytes

    assert format_bytes(np.int64(3 * 2**30)) == "3.00 GiB"  # numpy counts are byte counts too
    with pytest.raises(TypeError, match="use parse_bytes"):
        format_bytes("5 GiB")
    with pytest.raises(TypeError, match="already a number"):
        parse_bytes(5)
