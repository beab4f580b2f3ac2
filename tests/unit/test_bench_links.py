"""An emulated link's token bucket (``benchmarks/links.py``): 2 ms of the rate, never below twice
the loopback's MTU, so that a step's message crosses at the link's rate, not at memory speed."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import links  # noqa: E402


@pytest.mark.parametrize("rate,expected", [("100mbit", 131072), ("1gbit", 250000), ("10gbit", 2500000),
                                           ("800kbit", 131072)])
def test_the_bucket_holds_2_ms_of_the_rate_and_twice_the_loopback_mtu(rate, expected):
    assert links.burst_bytes(rate) == expected


@pytest.mark.parametrize("rate", ["fast", "100", "1.5gbit", "100mbps"])
def test_a_bad_rate_is_a_clear_error_before_anything_is_made(rate):
    with pytest.raises(ValueError, match=f"a link's rate must be a number with kbit, mbit or gbit \\(e.g. "
                                         f"100mbit\\), got '{rate}'"):
        links.burst_bytes(rate)
    with pytest.raises(SystemExit, match=f"--links {rate}: a link's rate must be"):
        links.check_link(rate)
