"""The shaped-link cluster (scaleopt.links): nodes in network namespaces of their own, joined by
tc-shaped veth links; made and removed by the harness. Needs root and iproute2: the tests skip
with the reason where either is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scaleopt import links
from scaleopt.cli.launch import free_port

pytestmark = pytest.mark.skipif(links.unavailable() is not None,
                                reason=str(links.unavailable()))
WORKER = os.path.join(os.path.dirname(__file__), "helpers", "link_worker.py")


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def test_a_cluster_is_made_and_every_namespace_it_made_is_removed_after():
    with links.ShapedCluster(nodes=3, rate="10mbit") as cluster:
        made = set(cluster.namespaces) | {cluster.switch}
        assert made <= _namespaces()
        for k in range(3):
            shown = subprocess.run(cluster.command(k, ["ip", "-o", "addr", "show", "eth0"]),
                                   capture_output=True, text=True, check=True).stdout
            assert f"inet {cluster.address(k)}/24" in shown
            qdisc = subprocess.run(cluster.command(k, ["tc", "qdisc", "show", "dev", "eth0"]),
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "10Mbit" in qdisc
    assert not made & _namespaces()


def test_an_error_inside_and_a_failing_step_while_making_leave_no_namespace(monkeypatch):
    with pytest.raises(KeyError):
        with links.ShapedCluster(nodes=2) as cluster:
            made = set(cluster.namespaces) | {cluster.switch}
            raise KeyError("inside")
    assert not made & _namespaces()
    real = links._run

    def failing_at_the_queue(argv):
        if "tbf" in argv:
            raise links.LinkError("refused")
        return real(argv)

    monkeypatch.setattr(links, "_run", failing_at_the_queue)
    cluster = links.ShapedCluster(nodes=2)
    with pytest.raises(links.LinkError, match="refused"):
        cluster.open()
    assert not ({cluster.switch, *cluster.namespaces} & _namespaces())


def test_namespaces_of_a_process_that_is_gone_are_swept():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    name = f"{links.PREFIX}{gone.pid}-0-n0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in links.sweep()
    assert name not in _namespaces()


def _all_reduce(tmp_path, nodes, per_node, numel):
    tmp_path.mkdir(parents=True)
    with links.ShapedCluster(nodes=nodes, rate="100mbit") as cluster:
        procs = cluster.launch(per_node, [sys.executable, WORKER, str(tmp_path), str(numel)],
                               free_port())
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                p.kill()
        sent = [cluster.bytes_sent(k) for k in range(nodes)]
    world = nodes * per_node
    assert codes == [0] * world
    for r in range(world):
        assert (tmp_path / f"rank{r}.txt").read_text() == f"{float(world)} {float(world)}"
    return sent


def test_gloo_between_nodes_passes_the_shaped_links_and_within_a_node_it_does_not(tmp_path):
    numel = 1_000_000  # 4 MB
    between = _all_reduce(tmp_path / "between", 2, 1, numel)
    for node in between:  # each rank sends and receives its half twice (ring all-reduce)
        assert node["up"] >= 4 * numel and node["down"] >= 4 * numel, between
    (within,) = _all_reduce(tmp_path / "within", 1, 2, numel)
    assert within["up"] < 64 * 1024 and within["down"] < 64 * 1024, within


def test_delay_and_loss_are_refused_by_name_where_the_kernel_has_no_netem():
    reason = links.netem_unavailable()
    if reason is None:
        with links.ShapedCluster(nodes=2, rate="10mbit", delay_ms=5) as cluster:
            qdisc = subprocess.run(cluster.command(0, ["tc", "qdisc", "show", "dev", "eth0"]),
                                   capture_output=True, text=True, check=True).stdout
            assert "netem" in qdisc and "delay 5ms" in qdisc and "tbf" in qdisc
    else:
        with pytest.raises(links.LinkError, match="netem"):
            links.ShapedCluster(nodes=2, delay_ms=5).open()


def test_a_rate_is_read_as_tc_writes_it_and_bad_ones_are_refused():
    assert links.rate_bits("100mbit") == 100e6
    assert links.rate_bits("1gbit") == 1e9
    assert links.rate_bits("12.5mbps") == 100e6
    for bad in ("fast", "0mbit", "10 furlongs"):
        with pytest.raises(ValueError, match="rate"):
            links.ShapedCluster(rate=bad)
    with pytest.raises(ValueError, match="nodes"):
        links.ShapedCluster(nodes=0)


@pytest.mark.slow
def test_the_link_benchmark_times_every_row_and_its_bytes_pass_the_shaped_links(tmp_path):
    """``scaleopt bench --link``: each row's step over a 1 Gbit link between 2 nodes; DGC
    sends over 100x fewer bytes than the dense all-reduce, and the shaping queues passed at
    least what the dense rounds sent."""
    import json

    from scaleopt.cli import bench, bench_links

    bench.main(["--link", "1gbit", "--rounds", "1", "--hidden", "256", "--layers", "2",
                "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "links.json").read_text())
    assert (tmp_path / "out" / "links.png").stat().st_size > 0
    one = result["links"]["1gbit"]
    assert one["parameters"] == 2 * (256 * 256 + 256) and one["world"] == 2
    rows = one["rows"]
    assert list(rows) == bench_links.ROWS
    assert all(len(row["step_s"]) == 1 and row["median_ms"] > 0 for row in rows.values())
    dense = rows[bench_links.DENSE]["bytes_sent"]
    assert rows["DGC 99.9% (DDP hook)"]["bytes_sent"] * 100 < dense
    assert rows["DGCMomentum 99.9%"]["bytes_sent"] * 100 < dense
    rounds = bench_links.WARMUP + 1
    for node in one["sent_per_node"]:
        assert node["up"] >= rounds * dense and node["down"] >= rounds * dense


# --------------------------------------------------------------------------------------------
# faults on the link: a `scaleopt train` run of 2 ranks on 2 nodes (each rank as one rank of a
# launch across machines: RANK, WORLD_SIZE, MASTER_ADDR in its environment)
# --------------------------------------------------------------------------------------------

RUN = ["--shard", "--steps", "200", "--checkpoint-every", "10", "--train-size", "8192",
       "--batch-size", "256", "--width", "64", "--no-progress", "--threads", "1"]
#: the process group's timeout in these runs, and how long past it a rank may take to exit
TIMEOUT_S, GRACE_S = 20, 30


def _numbers(result):
    return [{k: v for k, v in h.items() if k != "time_s"} for h in result["history"]]


@pytest.fixture(scope="module")
def never_cut(tmp_path_factory):
    """The same run on 2 local workers, never interrupted."""
    import json

    from scaleopt.cli import main

    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(["train", "--workers", "2", *RUN, "--out", str(out)]) == 0
    return json.loads((out / "result.json").read_text())


def _launch(cluster, run, resume=False):
    """Rank r of the run on node r (or its resumption from ``run``'s last checkpoint)."""
    import tempfile

    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    env = {"SCALEOPT_TIMEOUT": str(TIMEOUT_S), "PYTHONFAULTHANDLER": "1"}
    argv = [sys.executable, "-m", "scaleopt", "train",
            *(["--resume", str(run)] if resume else [*RUN, "--out", str(run)])]
    procs = []
    for rank in range(2):
        environment = {**os.environ, **env, **cluster.environment(rank), "RANK": str(rank),
                       "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
        procs.append(subprocess.Popen(cluster.command(rank, argv), env=environment,
                                      stdout=logs[rank], stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs, logs


def _wait_for_checkpoint(procs, run, step):
    import time

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            latest = int((run / "checkpoints" / "latest").read_text().split("-")[1])
        except (OSError, ValueError, IndexError):
            latest = -1
        if latest >= step:
            return
        assert all(p.poll() is None for p in procs), "the run ended before its link was cut"
        time.sleep(0.01)
    pytest.fail("the run did not reach its checkpoint in time")


def _ended(procs, logs, within):
    """Each rank's exit code and output; a rank still running after ``within`` seconds is
    killed (its session, by id) and fails the test."""
    import signal

    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=within))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"a rank was still running {within} s after its link was cut")
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
    return codes, texts


@pytest.mark.slow
def test_a_link_cut_for_five_seconds_is_ridden_through_with_the_uncut_numbers(tmp_path,
                                                                           never_cut):
    import json
    import time

    run = tmp_path / "run"
    with links.ShapedCluster(nodes=2, rate="1gbit") as cluster:
        procs, logs = _launch(cluster, run)
        _wait_for_checkpoint(procs, run, 20)
        cluster.cut(1)
        time.sleep(5)
        cluster.restore(1)
        codes, texts = _ended(procs, logs, 240)
    assert codes == [0, 0], texts
    assert _numbers(json.loads((run / "result.json").read_text())) == _numbers(never_cut)


@pytest.mark.slow
def test_a_link_cut_for_good_ends_every_rank_naming_the_lost_peer_and_the_run_resumes(
        tmp_path, never_cut):
    """A node cut off for good: both ranks end within the process group's timeout and a grace,
    each with a message of its own (rank 0: it lost rank 1; rank 1: not even the store on rank
    0's node answers) naming what the run was doing and the resume command; resumed, the run
    ends with the uncut numbers."""
    import json

    run = tmp_path / "run"
    with links.ShapedCluster(nodes=2, rate="1gbit") as cluster:
        procs, logs = _launch(cluster, run)
        _wait_for_checkpoint(procs, run, 20)
        cluster.cut(1)
        codes, texts = _ended(procs, logs, TIMEOUT_S + GRACE_S)
        assert all(code not in (0, None) for code in codes), texts
        for text in texts:
            assert "Traceback" not in text, text[-3000:]
            assert f"`scaleopt train --resume {run}`" in text, text[-3000:]
            assert "during step " in text or "during the all-reduce" in text, text[-3000:]
        assert "rank 0 lost rank 1" in texts[0], texts[0][-3000:]
        assert "rank 1 lost every other rank" in texts[1], texts[1][-3000:]
        cluster.restore(1)
        procs, logs = _launch(cluster, run, resume=True)
        codes, texts = _ended(procs, logs, 240)
    assert codes == [0, 0], texts
    result = json.loads((run / "result.json").read_text())
    assert result["complete"] and _numbers(result) == _numbers(never_cut)


@pytest.mark.slow
def test_with_two_ranks_per_node_the_benchmark_times_hsdp_with_dgc_between_the_nodes(tmp_path):
    """``--per-node 2``: FSDP2 inside each node and the nodes replicas (HSDP), dense or with
    DGCMomentum between them; DGC sends over 100x fewer bytes across the nodes."""
    import json

    from scaleopt.cli import bench, bench_links

    bench.main(["--link", "1gbit", "--world", "4", "--per-node", "2", "--rounds", "1",
                "--hidden", "256", "--layers", "2", "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "links.json").read_text())["links"]["1gbit"]["rows"]
    assert list(rows) == bench_links.ROWS + bench_links.HSDP_ROWS
    dense, dgc = (rows[name]["bytes_sent"] for name in bench_links.HSDP_ROWS)
    assert dense == 4 * (2 * (256 * 256 + 256)) / 2  # this rank's shard, once to the other node
    assert 0 < dgc * 100 < dense


@pytest.mark.slow
def test_local_workers_whose_loopback_fails_end_saying_so_and_the_run_resumes(tmp_path,
                                                                             never_cut):
    """``scaleopt train --workers 2`` on one machine whose loopback goes down for good (here a
    namespace of its own): the run ends within the process group's timeout and a grace with
    one last line naming the worker, the lost connection, what the run was doing and the
    resume command; resumed once the network is back, it ends with the uninterrupted numbers."""
    import json
    import tempfile

    run = tmp_path / "run"
    with links.ShapedCluster(nodes=1, rate=None) as cluster:
        env = {**os.environ, "SCALEOPT_TIMEOUT": str(TIMEOUT_S)}
        argv = [sys.executable, "-m", "scaleopt", "train", "--workers", "2", *RUN,
                "--max-restarts", "0", "--out", str(run)]
        log = tempfile.TemporaryFile("w+")
        procs = [subprocess.Popen(cluster.command(0, argv), env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)]
        _wait_for_checkpoint(procs, run, 20)
        subprocess.run(["ip", "-n", cluster.namespaces[0], "link", "set", "lo", "down"],
                       check=True)
        codes, texts = _ended(procs, [log], TIMEOUT_S + GRACE_S)
        last = texts[0].strip().splitlines()[-1]
        assert codes == [1], texts[0][-3000:]
        assert "lost its connection to another worker" in last, last
        assert "the network between them failed" in last and "during step " in last, last
        assert f"--resume {run}" in last, last
        subprocess.run(["ip", "-n", cluster.namespaces[0], "link", "set", "lo", "up"],
                       check=True)
        resumed = subprocess.run(cluster.command(0, [sys.executable, "-m", "scaleopt", "train",
                                                     "--resume", str(run)]),
                                 env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["complete"] and _numbers(result) == _numbers(never_cut)
