"""A store that answers an error status spools; only a refusal of the content drops.

Against a LOCAL STAND-IN for the InfluxDB v2 / VictoriaMetrics write API (a tiny HTTP
server answering POST /api/v2/write with the statuses and bodies those servers send:
Go's ``404 page not found`` for a wrong path, InfluxDB's JSON ``{"code", "message"}``
errors, a ``partial write`` / ``unable to parse`` 400 for refused lines). Issue #14 item 3:
a URL answering 404 lost every batch (``store write failed; 103 records lost``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from core.clock import FakeClock
from core.errors import PermanentError, TemporaryError
from core.records import EntityId, Event, NodeName, Sample
from storage.influxdb import InfluxDbStore
from storage.spool import SpoolingStore

T0 = 1_700_000_000.0

NOT_FOUND = (404, b"404 page not found\n")
UNPARSABLE = (400, b'{"code":"invalid","message":"unable to parse \'gpu,node=n1 x\': '
                   b'missing fields"}')
PARTIAL = (400, b'{"code":"invalid","message":"partial write: field type conflict: '
                b'input field \\"power_watts\\" on measurement \\"gpu\\" is type float"}')


class _StandIn(BaseHTTPRequestHandler):
    """Answers ``answers`` (status, body) in turn, then 204; records the bodies taken."""

    answers: ClassVar[list[tuple[int, bytes]]] = []
    taken: ClassVar[list[bytes]] = []
    tried: ClassVar[int] = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        cls = type(self)
        cls.tried += 1
        status, payload = cls.answers.pop(0) if cls.answers else (204, b"")
        if status == 204:
            cls.taken.append(body)
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    _StandIn.answers.clear()
    _StandIn.taken.clear()
    _StandIn.tried = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _store(url: str) -> InfluxDbStore:
    return InfluxDbStore(url=url, org="o", bucket="b", token="t", max_retries=0,
                         overlap_min_samples=0, clock=lambda: T0 + 100)


def _batch(i: int, n: int = 103) -> list[Sample]:
    return [Sample(metric="gpu_power_watts", value=float(i), observed_at=T0 + i,
                   node=NodeName("n1"), entity=EntityId(f"GPU-{g}")) for g in range(n)]


def _points_taken() -> list[str]:
    return [line for body in _StandIn.taken for line in body.decode().splitlines() if line]


@pytest.mark.parametrize("status", [401, 403, 404, 405, 408, 413, 429, 500, 502, 503])
def test_an_error_status_is_temporary_and_names_the_url_and_status(url: str,
                                                                   status: int) -> None:
    _StandIn.answers[:] = [(status, b'{"code":"x","message":"nope"}')]
    store = _store(url)
    try:
        with pytest.raises(TemporaryError) as caught:
            store.write(_batch(0), [])
        assert url in str(caught.value)
        assert f"HTTP {status}" in str(caught.value)
    finally:
        store.close()


@pytest.mark.parametrize("body", [
    b"<html>Bad Request</html>",  # a proxy in the way
    # VictoriaMetrics 1.x under a wrong URL prefix (its body, checked against the server)
    b'remoteAddr: "127.0.0.1:34796"; requestURI: /nope/api/v2/write; unsupported path '
    b'requested: "/nope/api/v2/write"',
])
def test_a_400_without_a_complaint_about_the_content_is_temporary(url: str,
                                                                  body: bytes) -> None:
    _StandIn.answers[:] = [(400, body)]
    store = _store(url)
    try:
        with pytest.raises(TemporaryError):
            store.write(_batch(0), [])
    finally:
        store.close()


@pytest.mark.parametrize("answer", [UNPARSABLE, PARTIAL, (422, b'{"code":"unprocessable '
                                    b'entity","message":"partial write: points beyond '
                                    b'retention policy dropped=3"}')])
def test_a_refusal_of_the_content_is_permanent(url: str, answer: tuple[int, bytes]) -> None:
    _StandIn.answers[:] = [answer]
    store = _store(url)
    try:
        with pytest.raises(PermanentError) as caught:
            store.write(_batch(0), [])
        assert f"HTTP {answer[0]}" in str(caught.value)
    finally:
        store.close()


def test_a_404_then_204_spools_and_loses_nothing(url: str, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(now=T0 + 100)
    spool = SpoolingStore(store=_store(url), path=tmp_path / "spool", retry_seconds=1.0,
                          max_retry_seconds=4.0, clock=clock)
    _StandIn.answers[:] = [NOT_FOUND] * 50
    caplog.set_level(logging.INFO)
    event = Event(kind="xid", code="79", observed_at=T0 + 3, node=NodeName("n1"),
                  entity=EntityId("GPU-0"), message="fallen off the bus")
    for i in range(6):  # one batch every 10 s, as the service writes
        spool.write(_batch(i), [event] if i == 3 else [])
        clock.advance(10)
    assert spool.depth == 6 * 103 + 1
    assert not spool.rejected
    assert _StandIn.taken == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once per outage
    assert url in errors[0].getMessage()
    assert "HTTP 404" in errors[0].getMessage()
    assert "lost" not in errors[0].getMessage()

    _StandIn.answers.clear()  # the URL is fixed: it answers 204 from now on
    clock.advance(10)
    spool.write(_batch(6), [])
    assert spool.depth == 0
    points = _points_taken()
    assert len([p for p in points if p.startswith("gpu,")]) == 7 * 103
    assert len([p for p in points if p.startswith("gpuhealth_event")]) == 1
    assert not spool.rejected
    spool.close()


def test_a_content_refusal_is_dropped_counted_and_named_and_the_rest_goes_on(
        url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(now=T0 + 100)
    spool = SpoolingStore(store=_store(url), path=tmp_path / "spool", clock=clock)
    caplog.set_level(logging.INFO)
    _StandIn.answers[:] = [UNPARSABLE]
    spool.write(_batch(0), [])  # refused for its content: dropped, not raised
    assert spool.depth == 0
    assert spool.rejected["permanent"] == 103
    refused = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refused) == 1
    assert "103" in refused[0]
    assert "gpu_power_watts" in refused[0]
    assert "unable to parse" in refused[0]
    assert url in refused[0]
    spool.write(_batch(1), [])
    assert len(_points_taken()) == 103
    spool.close()


def test_a_refusal_while_spooled_drops_only_that_batch(url: str, tmp_path: Path) -> None:
    clock = FakeClock(now=T0 + 100)
    spool = SpoolingStore(store=_store(url), path=tmp_path / "spool", retry_seconds=1.0,
                          clock=clock)
    _StandIn.answers[:] = [NOT_FOUND]
    spool.write(_batch(0), [])
    clock.advance(0.5)
    spool.write(_batch(1), [])
    assert spool.depth == 206
    _StandIn.answers[:] = [PARTIAL]  # the first spooled batch is refused, the rest taken
    clock.advance(10)
    spool.write(_batch(2), [])
    assert spool.depth == 0
    assert spool.rejected["permanent"] == 103
    assert len(_points_taken()) == 206
    spool.close()
