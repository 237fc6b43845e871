"""The DDP communication hook against plain DDP over gloo, 2 ranks."""

import ranks
from conftest import free_port


def test_hook_matches_gloo(pool):
    steps = 5
    results = pool.run(ranks.ddp_losses, free_port(), steps, ("shm", "staging"), timeout=150)
    for rank, res in enumerate(results):
        gloo_losses, _, gloo_sum = res["gloo"]
        assert len(gloo_losses) == steps
        for mode in ("shm", "staging"):
            losses, buckets, checksum = res[mode]
            assert len(buckets) > 1, f"the test model should span several buckets: {buckets}"
            for a, b in zip(gloo_losses, losses):
                assert abs(a - b) <= 1e-5 * max(abs(a), 1e-12), (rank, mode, gloo_losses, losses)
            assert abs(checksum - gloo_sum) <= 1e-5 * abs(gloo_sum)
    # Same parameters on every rank after training.
    assert results[0]["shm"][2] == results[1]["shm"][2]
    # Losses actually went down.
    assert results[0]["gloo"][0][-1] < results[0]["gloo"][0][0]
