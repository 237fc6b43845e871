"""ciuic.init(): torchrun's environment, job id and socket resolution."""

import numpy as np
import pytest
import torch

import ciuic

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
       "CIUIC_JOB", "TORCHELASTIC_RUN_ID", "CIUIC_SOCKET", "CIUIC_COORDINATOR",
       "CIUIC_PEER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
       "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_STEP_ID",
       "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")


@pytest.fixture
def env(monkeypatch, daemon):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CIUIC_SOCKET", daemon.socket)
    monkeypatch.setenv("CIUIC_ARENA_BYTES", str(16 << 20))
    return monkeypatch


def test_torchrun_environment(env):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "1")
    env.setenv("LOCAL_RANK", "0")
    env.setenv("LOCAL_WORLD_SIZE", "1")
    env.setenv("MASTER_ADDR", "10.1.2.3")
    env.setenv("MASTER_PORT", "29500")
    with ciuic.init() as comm:
        assert (comm.rank, comm.world_size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
        assert comm.job_id == "10.1.2.3:29500"
        assert comm.node_name == "pytest"
        t = torch.arange(4.0)
        comm.allreduce(t)  # one rank: unchanged
        assert t.tolist() == [0, 1, 2, 3]
    env.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    with ciuic.init() as comm:
        assert comm.job_id == "elastic-7"
    env.setenv("CIUIC_JOB", "my-job")
    with ciuic.init() as comm:
        assert comm.job_id == "my-job"
    with ciuic.init(job="explicit") as comm:
        assert comm.job_id == "explicit"


def test_explicit_arguments_override(env, daemon):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "8")
    env.setenv("CIUIC_SOCKET", "/nonexistent/ciuicd.sock")
    with ciuic.init(rank=0, world_size=1, local_rank=0, local_size=1, job="override",
                    socket=daemon.socket) as comm:
        assert (comm.rank, comm.world_size, comm.job_id) == (0, 1, "override")
        a = np.ones(3, np.float32)
        comm.allreduce(a, op="avg")
        assert a.tolist() == [1, 1, 1]


def test_missing_job_id(env):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ciuic.InvalidArgumentError, match="job id"):
        ciuic.init()


def test_bad_rank(env):
    with pytest.raises(ciuic.InvalidArgumentError, match="rank 2"):
        ciuic.init(rank=2, world_size=2, job="bad-rank")


def test_default_socket(env, daemon):
    assert ciuic.default_socket_path() == daemon.socket  # $CIUIC_SOCKET
    env.delenv("CIUIC_SOCKET")
    assert ciuic.default_socket_path() == "/run/ciuic/ciuicd.sock"


def test_resolve_coordinator():
    resolve = ciuic.resolve_coordinator
    env = {"CIUIC_COORDINATOR": "10.0.0.9:9000", "MASTER_ADDR": "10.0.0.1",
           "CIUIC_PEER_PORT": "7400"}
    # Explicit wins, for any job.
    assert resolve("h:1", 4, 2, env) == "h:1"
    assert resolve("h:1", 2, None, env) == "h:1"
    # One node (local_size unknown or == world_size): none needed, env ignored.
    assert resolve(None, 4, None, env) == ""
    assert resolve(None, 4, 4, env) == ""
    # Several nodes: $CIUIC_COORDINATOR, else $MASTER_ADDR:$CIUIC_PEER_PORT (default 7361).
    assert resolve(None, 4, 2, env) == "10.0.0.9:9000"
    assert resolve(None, 4, 2, {"MASTER_ADDR": "10.0.0.1", "CIUIC_PEER_PORT": "7400"}) == \
        "10.0.0.1:7400"
    assert resolve(None, 4, 1, {"MASTER_ADDR": "10.0.0.1"}) == "10.0.0.1:7361"
    assert ciuic.DEFAULT_PEER_PORT == 7361
    with pytest.raises(ciuic.InvalidArgumentError, match="coordinator"):
        resolve(None, 4, 2, {"MASTER_PORT": "29500"})


def test_multinode_without_coordinator(env):
    env.delenv("CIUIC_COORDINATOR", raising=False)
    with pytest.raises(ciuic.InvalidArgumentError, match="CIUIC_COORDINATOR"):
        ciuic.init(rank=0, world_size=2, local_rank=0, local_size=1, job="no-coordinator")


def test_single_node_has_no_coordinator(env):
    env.setenv("CIUIC_COORDINATOR", "10.9.9.9:1")  # not used: the job spans one node
    with ciuic.init(rank=0, world_size=1, job="one-node") as comm:
        assert comm.coordinator == ""


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3",
         "SLURM_STEP_NODELIST": "gpu[07-09,12]"}


def test_launch_env_slurm():
    got = ciuic.launch_env(SLURM)
    assert got == dict(rank=5, world_size=7, local_rank=1, local_size=2, job="slurm-4242.3",
                       launcher="slurm")
    # The last node of "2(x3),1" runs one task.
    assert ciuic.launch_env(dict(SLURM, SLURM_NODEID="3", SLURM_PROCID="6",
                                 SLURM_LOCALID="0"))["local_size"] == 1
    # No SLURM_TASKS_PER_NODE: the uniform SLURM_NTASKS_PER_NODE.
    env = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    assert ciuic.launch_env(dict(env, SLURM_NTASKS_PER_NODE="4"))["local_size"] == 4
    assert ciuic.launch_env(env)["local_size"] is None
    # The job id: $CIUIC_JOB, $TORCHELASTIC_RUN_ID before Slurm's; step id default 0.
    assert ciuic.launch_env(dict(SLURM, CIUIC_JOB="mine"))["job"] == "mine"
    assert ciuic.launch_env(dict(SLURM, TORCHELASTIC_RUN_ID="te"))["job"] == "te"
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert ciuic.launch_env(env)["job"] == "slurm-4242.0"
    # The coordinator under Slurm: the step's first host.
    assert ciuic.resolve_coordinator(None, 7, 2, SLURM) == "gpu07:7361"
    assert ciuic.resolve_coordinator(None, 7, 2, {"SLURM_JOB_NODELIST": "a1,b[2-3]",
                                                  "CIUIC_PEER_PORT": "9"}) == "a1:9"
    assert ciuic.resolve_coordinator(
        None, 7, 2, {"SLURM_JOB_NODELIST": "rack[3-4]-n[010-011]"}) == "rack3-n010:7361"
    # MASTER_ADDR wins over the host list.
    assert ciuic.resolve_coordinator(None, 7, 2, dict(SLURM, MASTER_ADDR="m")) == "m:7361"


def test_launch_env_torchrun_wins_over_slurm():
    env = dict(SLURM, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="h", MASTER_PORT="29500")
    assert ciuic.launch_env(env) == dict(rank=0, world_size=2, local_rank=0, local_size=2,
                                         job="h:29500", launcher="torchrun")
    assert ciuic.launch_env({})["launcher"] is None


@pytest.mark.parametrize("environ,match", [
    (dict(SLURM, SLURM_TASKS_PER_NODE="2(3)"), "SLURM_TASKS_PER_NODE"),
    (dict(SLURM, SLURM_TASKS_PER_NODE="x"), "SLURM_TASKS_PER_NODE"),
    (dict(SLURM, SLURM_NODEID="4"), "SLURM_NODEID 4"),
    (dict(SLURM, SLURM_PROCID="five"), "SLURM_PROCID"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a"}, "LOCAL_RANK"),
])
def test_launch_env_refuses_bad_values(environ, match):
    with pytest.raises(ciuic.InvalidArgumentError, match=match):
        ciuic.launch_env(environ)


def test_bad_slurm_host_list():
    with pytest.raises(ciuic.InvalidArgumentError, match="host list"):
        ciuic.resolve_coordinator(None, 4, 2, {"SLURM_JOB_NODELIST": "gpu[01-02"})


def test_init_from_slurm(env):
    for k, v in dict(SLURM, SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
                     SLURM_NODEID="0", SLURM_TASKS_PER_NODE="1").items():
        env.setenv(k, v)
    with ciuic.init() as comm:
        assert (comm.rank, comm.world_size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
        assert comm.job_id == "slurm-4242.3"
