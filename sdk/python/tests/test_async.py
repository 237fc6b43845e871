"""Async handles, out-of-order named submission, torch futures."""

import ranks


def test_async_handles_and_futures(pool):
    assert pool.run(ranks.async_ops) == [True, True]
