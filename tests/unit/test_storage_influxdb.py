"""The Flux reader against a LOCAL STAND-IN for InfluxDB 2 (no InfluxDB 2 server can run
here, docs/infra.md §2): a tiny HTTP server that answers POST /api/v2/query with annotated
CSV shaped as InfluxDB documents it (annotations #datatype, #group, #default; one table per
series). Writes are tested against real VictoriaMetrics in tests/integration; here, the
split of a large batch into two bodies (one posted while the other is encoded) against a
stand-in that records the bodies and fails on demand."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from core.errors import PermanentError, TemporaryError
from core.records import EntityId, EntityRef, Event, NodeName, Sample
from storage.influxdb import InfluxDbStore

CSV = (
    "#datatype,string,long,dateTime:RFC3339,dateTime:RFC3339,dateTime:RFC3339,double,string,"
    "string,string,string\r\n"
    "#group,false,false,true,true,false,false,true,true,true,true\r\n"
    "#default,_result,,,,,,,,,\r\n"
    ",result,table,_start,_stop,_time,_value,_field,_measurement,entity,node\r\n"
    ",,0,2023-11-14T22:00:00Z,2023-11-14T23:00:00Z,2023-11-14T22:13:20Z,41.5,temperature_celsius,"
    "gpu,GPU-b,n1\r\n"
    ",,1,2023-11-14T22:00:00Z,2023-11-14T23:00:00Z,2023-11-14T22:13:20Z,40,temperature_celsius,"
    "gpu,GPU-a,n1\r\n"
    ",,1,2023-11-14T22:00:00Z,2023-11-14T23:00:00Z,2023-11-14T22:13:30Z,40.5,temperature_celsius,"
    "gpu,GPU-a,n1\r\n"
    "\r\n"
)


class _Handler(BaseHTTPRequestHandler):
    queries: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        assert self.path.startswith("/api/v2/query")
        type(self).queries.append(json.loads(body))
        payload = CSV.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/csv; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def test_flux_reader_parses_annotated_csv_from_a_stand_in() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = InfluxDbStore(url=f"http://127.0.0.1:{server.server_port}", org="o",
                              bucket="fleet", token="t")
        frame = store.read("gpu_temperature_celsius",
                           [EntityRef(node=NodeName("n1"), entity=EntityId("GPU-a"))],
                           1_700_000_000.0, 1_700_000_100.0, step_seconds=10)
        assert frame.to_dict("records") == [
            {"observed_at": 1_700_000_000.0, "node": "n1", "entity": "GPU-a", "value": 40.0},
            {"observed_at": 1_700_000_010.0, "node": "n1", "entity": "GPU-a", "value": 40.5},
            {"observed_at": 1_700_000_000.0, "node": "n1", "entity": "GPU-b", "value": 41.5},
        ]
        query = str(_Handler.queries[-1]["query"])
        assert 'r._measurement == "gpu" and r._field == "temperature_celsius"' in query
        assert '(r.node == "n1" and r.entity == "GPU-a")' in query
        assert "aggregateWindow(every: 10000ms, fn: mean" in query
        assert store.entities() == [EntityRef(node=NodeName("n1"), entity=EntityId("GPU-a")),
                                    EntityRef(node=NodeName("n1"), entity=EntityId("GPU-b"))]
        store.close()
    finally:
        server.shutdown()
        server.server_close()


class _Writes(BaseHTTPRequestHandler):
    """Records POST /api/v2/write bodies; answers ``statuses`` in turn, then 204."""

    bodies: ClassVar[list[bytes]] = []
    statuses: ClassVar[list[int]] = []

    def do_POST(self) -> None:
        assert self.path.startswith("/api/v2/write")
        type(self).bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        status = type(self).statuses.pop(0) if type(self).statuses else 204
        payload = b'{"code":"invalid","message":"refused"}' if status != 204 else b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def _batch(readings: int = 10, metrics: int = 3) -> list[Sample]:
    out = []
    for r in range(readings):
        at = 1_700_000_000.0 + r  # one time object per reading, as a collector stamps it
        out += [Sample(metric=f"gpu_m{m}_celsius", value=float("nan") if (r, m) == (1, 0)
                       else float(r * metrics + m), observed_at=at,
                       node=NodeName("n 1"), entity=EntityId(f"GPU-{r % 2}"))
                for m in range(metrics)]
    return out


def _serve() -> ThreadingHTTPServer:
    _Writes.bodies.clear()
    _Writes.statuses.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Writes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_large_batch_is_posted_in_two_halves_with_the_same_lines_and_counts() -> None:
    server = _serve()
    url = f"http://127.0.0.1:{server.server_port}"
    clock = lambda: 1_700_000_100.0  # noqa: E731
    try:
        serial = InfluxDbStore(url=url, org="o", bucket="b", token="t", overlap_min_samples=0,
                               clock=clock)
        serial.write(_batch(), [])
        assert len(_Writes.bodies) == 1
        whole = _Writes.bodies.pop().split(b"\n")
        overlapped = InfluxDbStore(url=url, org="o", bucket="b", token="t",
                                   overlap_min_samples=10, clock=clock)
        overlapped.write(_batch(), [Event(kind="xid", code="79", node=NodeName("n 1"),
                                          entity=EntityId("GPU-0"), observed_at=1.7e9,
                                          message="fell off the bus")])
        first, second = (body.split(b"\n") for body in _Writes.bodies)
        # 30 samples in readings of 3: the cut (15) moves to the reading boundary (15), no
        # reading is split over two lines, and the event goes with the second half
        assert first + second[:-1] == whole
        assert len(first) == 5
        assert second[-1].startswith(b"gpuhealth_event,")
        assert serial.rejected == overlapped.rejected == {"nan": 1}
        serial.close()
        overlapped.close()
    finally:
        server.shutdown()
        server.server_close()


def test_reading_is_not_split_when_the_half_falls_inside_it() -> None:
    server = _serve()
    try:
        store = InfluxDbStore(url=f"http://127.0.0.1:{server.server_port}", org="o",
                              bucket="b", token="t", overlap_min_samples=2,
                              clock=lambda: 1_700_000_100.0)
        store.write(_batch(readings=3, metrics=4), [])  # 12 samples: half = 6, inside reading 2
        lines = [body.split(b"\n") for body in _Writes.bodies]
        assert [len(body) for body in lines] == [2, 1]  # a split reading would make 4 lines
        store.close()
    finally:
        server.shutdown()
        server.server_close()


def test_failed_first_half_raises_and_the_second_is_not_posted() -> None:
    server = _serve()
    failures: list[bytes] = []
    try:
        store = InfluxDbStore(url=f"http://127.0.0.1:{server.server_port}", org="o",
                              bucket="b", token="t", overlap_min_samples=10, max_retries=0,
                              on_error=lambda conf, body, exc: failures.append(body),
                              clock=lambda: 1_700_000_100.0)
        _Writes.statuses[:] = [503]
        with pytest.raises(TemporaryError):
            store.write(_batch(), [])
        assert len(_Writes.bodies) == 1
        assert failures == _Writes.bodies
        _Writes.bodies.clear()
        failures.clear()
        _Writes.statuses[:] = [204, 400]
        with pytest.raises(PermanentError):
            store.write(_batch(), [])
        assert len(_Writes.bodies) == 2
        assert failures == _Writes.bodies[1:]
        store.close()
    finally:
        server.shutdown()
        server.server_close()


def test_write_stream_posts_every_batch_in_order_as_write_would() -> None:
    server = _serve()
    url = f"http://127.0.0.1:{server.server_port}"
    clock = lambda: 1_700_000_100.0  # noqa: E731
    try:
        one = InfluxDbStore(url=url, org="o", bucket="b", token="t", overlap_min_samples=0,
                            clock=clock)
        batches = [(_batch(readings=4 + i), []) for i in range(5)]
        for samples, events in batches:
            one.write(samples, events)
        each = list(_Writes.bodies)
        _Writes.bodies.clear()
        streamed = InfluxDbStore(url=url, org="o", bucket="b", token="t", clock=clock,
                                 stream_depth=2)
        seen: list[int] = []
        assert streamed.write_stream(iter(batches), on_written=seen.append) == 5
        assert _Writes.bodies == each
        assert seen == [1, 2, 3, 4, 5]
        assert streamed.rejected == one.rejected == {"nan": 5}
        # an empty batch (all rejected) counts as written and posts nothing
        _Writes.bodies.clear()
        nan = [Sample(metric="gpu_m0_celsius", value=float("nan"), observed_at=1.7e9,
                      node=NodeName("n1"), entity=EntityId("GPU-0"))]
        assert streamed.write_stream([(nan, []), batches[0]]) == 2
        assert _Writes.bodies == each[:1]
        one.close()
        streamed.close()
    finally:
        server.shutdown()
        server.server_close()


def test_write_stream_stops_at_the_failed_batch() -> None:
    server = _serve()
    failures: list[bytes] = []
    try:
        store = InfluxDbStore(url=f"http://127.0.0.1:{server.server_port}", org="o",
                              bucket="b", token="t", max_retries=0, stream_depth=2,
                              on_error=lambda conf, body, exc: failures.append(body),
                              clock=lambda: 1_700_000_100.0)
        taken: list[int] = []

        def batches():  # endless: the helper must stop taking once a batch failed
            i = 0
            while True:
                taken.append(i)
                yield _batch(readings=3 + i % 6), []
                i += 1

        seen: list[int] = []
        _Writes.statuses[:] = [204, 204, 503]
        with pytest.raises(TemporaryError):
            store.write_stream(batches(), on_written=seen.append)
        assert seen == [1, 2]
        assert len(_Writes.bodies) == 3  # the third was tried and failed; nothing after it
        assert failures == _Writes.bodies[2:]
        # encoded ahead (at most stream_depth queued, one in hand), never sent
        assert 3 <= len(taken) <= 3 + 2 + 1
        _Writes.bodies.clear()
        _Writes.statuses[:] = [400]
        with pytest.raises(PermanentError):
            store.write_stream([(_batch(), []), (_batch(), [])])
        assert len(_Writes.bodies) == 1
        # an error of the batches' own source comes out after the batches before it
        _Writes.bodies.clear()

        def broken():
            yield _batch(), []
            raise ValueError("bad record in the recording")

        seen.clear()
        with pytest.raises(ValueError, match="bad record"):
            store.write_stream(broken(), on_written=seen.append)
        assert (seen, len(_Writes.bodies)) == ([1], 1)
        store.close()
    finally:
        server.shutdown()
        server.server_close()
