"""Jobs spanning two daemons ("nodes") on this host, UCX over TCP between them:
2 nodes x 1 rank and 2 nodes x 2 ranks (see conftest.MultiNodePool)."""

import pytest

import ranks
from conftest import free_port

SHAPES = [(2, 1), (2, 2)]
SHAPE_IDS = ["2x1", "2x2"]
# (lib, dtype, with the ~1M-element size): a few dtypes of each kind.
CASES = [("numpy", "float32", True), ("numpy", "float64", False), ("numpy", "int32", False),
         ("numpy", "uint8", False), ("torch", "float32", True), ("torch", "bfloat16", False),
         ("torch", "float16", False), ("torch", "int64", True)]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_identity(mn_pool, cluster, shape):
    nodes, per_node = shape
    got = mn_pool.run(shape, ranks.mn_identity)
    for rank, (r, world, local_rank, local_size, node_name, coordinator) in enumerate(got):
        assert (r, world, local_rank, local_size) == (rank, nodes * per_node, rank % per_node,
                                                      per_node)
        assert node_name == f"node{rank // per_node}"
        assert coordinator == cluster.coordinator


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("lib,dtype,big", CASES, ids=[f"{l}-{d}" for l, d, _ in CASES])
def test_collectives(mn_pool, shape, lib, dtype, big):
    checks = mn_pool.run(shape, ranks.mn_collectives, lib, dtype, 21, big)
    assert len(set(checks)) == 1 and checks[0] > 0


def test_ddp_hook_matches_gloo_2x1(mn_pool):
    steps = 5
    results = mn_pool.run((2, 1), ranks.ddp_losses, free_port(), steps, ("shm",), timeout=150)
    for rank, res in enumerate(results):
        gloo_losses, _, gloo_sum = res["gloo"]
        losses, buckets, checksum = res["shm"]
        assert len(gloo_losses) == len(losses) == steps
        assert len(buckets) > 1, f"the test model should span several buckets: {buckets}"
        for a, b in zip(gloo_losses, losses):
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-12), (rank, gloo_losses, losses)
        assert abs(checksum - gloo_sum) <= 1e-5 * abs(gloo_sum)
    assert results[0]["shm"][2] == results[1]["shm"][2]  # same parameters on both nodes
    assert results[0]["gloo"][0][-1] < results[0]["gloo"][0][0]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_mismatch_across_nodes_fails_on_every_rank(mn_pool, shape):
    results = mn_pool.run(shape, ranks.mn_mismatch)
    assert len(results) == shape[0] * shape[1]
    for name, code, message in results:
        assert (name, code) == ("InvalidArgumentError", 3), message
        assert "grads.mismatch.nodes" in message, message


def test_ddp_hook_with_int8_compression_tracks_uncompressed(cluster):
    """int8 with error feedback across 2 nodes: losses stay within 2 % of the
    uncompressed run's (same seed, same data)."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "..", "examples", "train_ddp.py")
    results = {}
    for codec in (None, "int8"):
        cmd = [sys.executable, script, "--backend", "ciuic", "--nodes", "2", "--nprocs", "1",
               "--steps", "12", "--seed", "3", "--model-size", "small"]
        if codec:
            cmd += ["--compression", codec]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                                 env=dict(os.environ, UCX_TLS="tcp"))
        except subprocess.TimeoutExpired as e:
            def text(b):
                return (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-2000:]
            raise AssertionError(f"train_ddp --compression {codec} ran past 240 s\n"
                                 f"stdout: {text(e.stdout)}\nstderr: {text(e.stderr)}") from None
        assert out.returncode == 0, out.stderr[-2000:]
        results[codec] = json.loads(out.stdout.strip().splitlines()[-1])
    exact = results[None]["final_loss"]
    lossy = results["int8"]["final_loss"]
    assert results["int8"]["compression"] == "int8"
    assert abs(lossy - exact) <= 0.02 * abs(exact), (exact, lossy)
