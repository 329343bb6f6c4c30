"""Lease leader election against the local Kubernetes API stand-in.

No real API server can run here; ``tests/k8s_api.py`` follows the documented
``coordination.k8s.io/v1`` Lease API (create 201 / 409 AlreadyExists, read 404,
replace with ``resourceVersion`` 200 / 409 Conflict). Time is an injected fake clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from core.clock import FakeClock
from core.errors import ConfigError, TemporaryError
from remediation.kubernetes_lease import KubernetesLeaseElector
from tests.k8s_api import K8sApi, running_k8s_api

T0 = 1_800_000_000.0


@pytest.fixture
def api() -> Iterator[K8sApi]:
    with running_k8s_api() as server:
        yield server


def elector(api: K8sApi, identity: str, clock: FakeClock,
            ttl: float = 15) -> KubernetesLeaseElector:
    return KubernetesLeaseElector(identity=identity, host=api.url, namespace="gpuhealth",
                                  ttl_seconds=ttl, clock=clock)


def spec(api: K8sApi) -> dict[str, object]:
    return dict(api.leases[("gpuhealth", "gpuhealth-controller")]["spec"])


def test_one_of_two_leads_and_the_other_takes_over_after_the_ttl(api: K8sApi) -> None:
    clock = FakeClock(now=T0)
    a, b = elector(api, "ctl-a", clock), elector(api, "ctl-b", clock)

    assert a.try_acquire() is True
    assert b.try_acquire() is False
    assert a.leader() == b.leader() == "ctl-a"
    first = spec(api)
    assert first["holderIdentity"] == "ctl-a"
    assert first["leaseDurationSeconds"] == 15
    assert first["leaseTransitions"] == 0

    clock.advance(10)
    assert a.renew() is True
    renewed = spec(api)
    assert renewed["acquireTime"] == first["acquireTime"]
    assert renewed["renewTime"] != first["renewTime"]
    clock.advance(10)  # 10 s after the renew: still within the TTL
    assert b.try_acquire() is False
    assert b.retry_after_seconds == 5.0

    clock.advance(6)  # a stopped renewing: renewTime + 15 s has passed
    assert a.leader() is None
    assert b.try_acquire() is True
    taken = spec(api)
    assert taken["holderIdentity"] == "ctl-b"
    assert taken["leaseTransitions"] == 1
    assert a.renew() is False  # leadership lost
    assert a.try_acquire() is False
    assert b.leader() == "ctl-b"


def test_release_lets_the_standby_take_over_at_once(api: K8sApi) -> None:
    clock = FakeClock(now=T0)
    a, b = elector(api, "ctl-a", clock), elector(api, "ctl-b", clock)
    assert a.try_acquire()
    b.release()  # not the holder: does nothing
    assert a.leader() == "ctl-a"
    a.release()
    assert spec(api)["holderIdentity"] == ""
    assert a.leader() is None
    assert b.try_acquire() is True
    assert spec(api)["leaseTransitions"] == 1


def test_a_concurrent_write_makes_the_slower_candidate_lose_with_409(api: K8sApi) -> None:
    clock = FakeClock(now=T0)
    a, b = elector(api, "ctl-a", clock), elector(api, "ctl-b", clock)
    assert a.try_acquire()
    clock.advance(20)  # a's lease expired; b and c race to take it
    raced: list[bool] = []

    def c_writes_first(method: str, path: str) -> None:
        if method == "PUT" and "/leases/" in path and not raced:
            raced.append(True)
            lease = api.leases[("gpuhealth", "gpuhealth-controller")]
            lease["spec"].update(holderIdentity="ctl-c",
                                 renewTime="2027-01-15T08:00:20.000000Z")
            api.revision += 1
            lease["metadata"]["resourceVersion"] = str(api.revision)

    api.on_request(c_writes_first)
    assert b.try_acquire() is False  # its PUT carried the old resourceVersion: 409
    assert raced
    assert b.leader() == "ctl-c"


def test_creation_race_is_lost_with_already_exists(api: K8sApi) -> None:
    clock = FakeClock(now=T0)
    b = elector(api, "ctl-b", clock)
    created: list[bool] = []

    def a_creates_first(method: str, path: str) -> None:
        # ctl-a's create lands between b's 404 and b's create (the stand-in's own POST).
        if method == "POST" and path.endswith("/leases") and not created:
            created.append(True)
            api.handle("POST", path, {}, json.dumps({
                "metadata": {"name": "gpuhealth-controller"},
                "spec": {"holderIdentity": "ctl-a", "leaseDurationSeconds": 15,
                         "renewTime": "2027-01-15T08:00:00.000000Z",
                         "acquireTime": "2027-01-15T08:00:00.000000Z",
                         "leaseTransitions": 0}}).encode())

    api.on_request(a_creates_first)
    assert b.try_acquire() is False
    assert api.requests["POST lease"] == 2
    assert b.leader() == "ctl-a"


def test_unreachable_server_is_a_temporary_error() -> None:
    with running_k8s_api() as gone:
        url = gone.url
    lost = KubernetesLeaseElector(identity="x", host=url, clock=FakeClock(now=T0),
                                  request_timeout_seconds=1)
    with pytest.raises(TemporaryError, match="gpuhealth-controller"):
        lost.try_acquire()


def test_server_errors_are_temporary(api: K8sApi) -> None:
    api.fail("GET", r"/leases/", 500)
    with pytest.raises(TemporaryError, match="HTTP 500"):
        elector(api, "a", FakeClock(now=T0)).try_acquire()


@pytest.mark.parametrize("ttl", [0, 0.5, 7.5, 5000, float("nan")])
def test_bad_ttl_is_a_config_error(ttl: float) -> None:
    with pytest.raises(ConfigError, match="ttl_seconds"):
        KubernetesLeaseElector(identity="a", host="http://127.0.0.1:1", ttl_seconds=ttl)
