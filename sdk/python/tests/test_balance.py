"""Communicator.balance(): each rank's idle and busy time from its own
operations' timings, checked against what the test made each rank do, and
the arithmetic (ciuic.balance) against hand-computed cases."""

import numpy as np
import pytest

import ranks
from ciuic import balance as bal


# --------------------------------------------------- arithmetic, no daemon

def _rows(per_rank, walls, samples=None, dropped=0):
    """Padded rows from per-rank lists of (name, submitted, completed)."""
    plain = [bal.row_of(t, 0, w, None if samples is None else samples[r], dropped)
             for r, (t, w) in enumerate(zip(per_rank, walls))]
    n = max(int(r[0]) for r in plain)
    return np.stack([bal.padded(r, n) for r in plain]), n


def test_synchronous_operations_sum_their_lags():
    # Rank 1 submits each op 30 late; every op completes 5 after the last
    # submission, at the same moment on both.
    r0 = [("#1", 0, 35), ("#2", 100, 135), ("#3", 200, 235)]
    r1 = [("#1", 30, 35), ("#2", 130, 135), ("#3", 230, 235)]
    rows, n = _rows([r0, r1], [300, 300])
    b = bal.compute(rows, n)
    assert b.ops == 3
    assert [round(i * 1e9) for i in b.idle] == [90, 0]
    assert [round(x * 1e9) for x in b.busy] == [210, 300]
    assert b.slowest == 1
    assert b.speed[0] > b.speed[1]


def test_overlapping_operations_count_their_largest_lag_once():
    # DDP-like: 3 ops in flight at once on rank 0, submitted 10, 20, 30 ahead
    # of rank 1; they overlap, so rank 0 idles only 30 (not 60).
    r0 = [("#1", 0, 15), ("#2", 10, 35), ("#3", 20, 55)]
    r1 = [("#1", 10, 15), ("#2", 30, 35), ("#3", 50, 55)]
    rows, n = _rows([r0, r1], [100, 100])
    assert [round(i * 1e9) for i in bal.compute(rows, n).idle] == [30, 0]


def test_named_operations_match_by_name_and_occurrence_not_order():
    r0 = [("b", 0, 40), ("a", 50, 90), ("b", 100, 140)]
    r1 = [("a", 80, 90), ("b", 30, 40), ("b", 130, 140)]
    rows, n = _rows([r0, r1], [200, 200])
    b = bal.compute(rows, n)
    assert b.ops == 3
    assert [round(i * 1e9) for i in b.idle] == [90, 0]


def test_operations_missing_on_a_rank_are_left_out():
    r0 = [("#1", 0, 20), ("#2", 50, 60)]
    r1 = [("#1", 15, 20)]
    rows, n = _rows([r0, r1], [100, 100])
    b = bal.compute(rows, n)
    assert b.ops == 1
    assert [round(i * 1e9) for i in b.idle] == [15, 0]


def test_no_operations_means_no_idle_and_speed_from_samples():
    rows, n = _rows([[], [], []], [100, 100, 100], samples=[10, 20, 30])
    b = bal.compute(rows, n)
    assert b.ops == 0 and b.idle == [0.0, 0.0, 0.0]
    assert b.slowest == 0
    assert b.split(60) == [10, 20, 30]


def test_samples_given_on_some_ranks_only_is_an_error():
    rows, n = _rows([[], []], [100, 100], samples=[10, 10])
    rows[1][2] = -1
    with pytest.raises(ValueError, match=r"ranks \[1\] gave no samples"):
        bal.compute(rows, n)


@pytest.mark.parametrize("speeds,total,minimum", [
    ([1.0, 1.0], 9, 1), ([3.0, 1.0], 100, 1), ([1e-9, 5.0, 5.0], 7, 2), ([0.0, 0.0], 4, 0),
    ([2.0, 1.0, 1.0, 1.0, 1.0], 1, 0), ([1.0] * 3, 3, 1)])
def test_split_sums_to_the_batch_and_follows_speed(speeds, total, minimum):
    b = bal.Balance([1] * len(speeds), [0] * len(speeds), [1] * len(speeds), 0, 0)
    b.speed = speeds
    got = b.split(total, minimum)
    assert sum(got) == total and min(got) >= minimum
    # Against the plain rule: where no rank is held at the minimum, never
    # more than one sample off its exact share of the batch.
    norm = sum(speeds)
    shares = [total * (s / norm if norm else 1 / len(speeds)) for s in speeds]
    if min(shares) >= minimum:
        for share, g in zip(shares, got):
            assert abs(g - share) < 1.0 + 1e-9, (speeds, got)
    else:
        assert got[speeds.index(min(speeds))] == minimum


def test_split_refuses_too_small_a_batch():
    b = bal.Balance([1, 1], [0, 0], [1, 1], 0, 0)
    with pytest.raises(ValueError, match="cannot split 1 samples among 2 ranks"):
        b.split(1)


def test_keys_are_stable_and_distinct():
    assert bal.op_key("#1", 0) == bal.op_key("#1", 0)
    assert len({bal.op_key(n, o) for n in ("#1", "#2", "a") for o in range(3)}) == 9
    assert 0 <= bal.op_key("x", 5) < 2**63


# ------------------------------------------------------------- real runs

def _check_skew(results, world, slow, delay, steps, per_step):
    dicts = [d for d, _ in results]
    splits = [s for _, s in results]
    assert all(d == dicts[0] for d in dicts), "ranks disagree on the balance"
    assert all(s == splits[0] for s in splits)
    b = dicts[0]
    assert b["ops"] == steps * per_step, b
    assert b["slowest"] == slow, b
    # Each other rank is ahead by delay/2 per op and waits that per step
    # times per_step (the overlap counted once, not summed per op: that
    # would be per_step * (per_step + 1) / 2 times delay/2).
    want = steps * per_step * delay / 2
    for r in range(world):
        if r == slow:
            assert b["idle"][r] < 0.25 * want, b
        else:
            assert 0.6 * want < b["idle"][r] < 1.45 * want, (want, b)
            assert b["share"][r] < b["share"][slow]
    # The slow rank processed half the samples in about twice the busy time:
    # a quarter of the speed, so about a fifth of the batch.
    assert splits[0][slow] < 1000 / world * 0.6, splits[0]
    assert sum(splits[0]) == 1000


def test_balance_names_the_slow_rank_one_node(pool):
    steps, per_step, delay = 6, 4, 0.02
    got = pool.run(ranks.balance_skew, 1, delay, steps, per_step, 1000)
    _check_skew(got, pool.world, 1, delay, steps, per_step)


def test_balance_names_the_slow_rank_across_nodes(mn_pool):
    steps, per_step, delay = 6, 4, 0.02
    got = mn_pool.run((2, 1), ranks.balance_skew, 0, delay, steps, per_step, 20000)
    _check_skew(got, 2, 0, delay, steps, per_step)


def test_balance_measures_the_newest_operations_only(pool):
    for ops, dropped in pool.run(ranks.balance_many_ops, 1100):
        assert (ops, dropped) == (1024, 1100 - 1024)


def test_balance_checks_its_samples(pool):
    for message in pool.run(ranks.balance_bad_samples):
        assert "samples must be a count >= 0, got -3" in message


def test_the_balancing_example_moves_samples_off_the_slow_rank():
    """examples/train_balanced.py, 2 nodes x 1 rank, rank 1 slowed per
    sample: every epoch's balance() names rank 1, the split moves samples
    to rank 0, and the losses are those of equal batches (same global
    batches; only who computes which sample changes)."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "..", "examples", "train_balanced.py")
    got = {}
    for mode in ("--balance", "--no-balance"):
        cmd = [sys.executable, script, "--nodes", "2", "--nprocs", "1", "--epochs", "3",
               "--steps-per-epoch", "4", "--global-batch", "96", "--slow-ms-per-sample", "2.0",
               "--threads", "1", mode]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, UCX_TLS="tcp"))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    on, off = got["--balance"], got["--no-balance"]
    assert on["slowest"] == [1, 1, 1] and off["slowest"] == [1, 1, 1], (on, off)
    assert off["splits"] == [[48, 48]] * 3
    assert on["splits"][0] == [48, 48]
    # Rank 1 is several times slower per sample (the busy loop alone is
    # 96 ms a step at 48 samples): it gets well under half from the first
    # rebalancing on, even on a loaded machine.
    for split in on["splits"][1:]:
        assert sum(split) == 96 and split[1] < 40, on["splits"]
    assert abs(on["final_loss"] - off["final_loss"]) <= 1e-4 * abs(off["final_loss"]), (on, off)
