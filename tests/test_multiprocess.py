"""Two processes, 4 CPU devices each, one global mesh of 8 (jax.distributed on a loopback
coordinator, JAX's CPU collectives): the sharded decode loop equals the single-process run."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import multiprocess_loop
from helpers import assert_bytes_equal

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.long  # two processes of their own, each importing jax and compiling: 6 s
def test_two_processes_equal_one(tmp_path):
    import jax

    seed = int(np.random.default_rng().integers(0, 2**31 - 1))
    out = tmp_path / "result.npz"
    port = free_port()
    # (No empty PYTHONPATH entry: it would mean the current folder.)
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    script = os.path.join(HERE, "multiprocess_loop.py")
    # cwd: a folder without the source checkout, which would shadow the installed jaxkv.
    procs = [subprocess.Popen([sys.executable, script, str(port), str(i), str(seed), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:  # on a timeout or a failure, nothing is left running
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    got = dict(np.load(out))
    cpus = jax.devices("cpu")  # the 8 emulated CPU devices (conftest), also on a GPU machine
    with jax.default_device(cpus[0]):
        want = multiprocess_loop.run(seed, cpus[:8])
    assert set(got) == set(want)
    for name in want:
        assert_bytes_equal(got[name], want[name], name)
    assert want["lengths"].tolist()[0] > 0  # the loop did write
