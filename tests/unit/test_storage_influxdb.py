"""The Flux reader against a LOCAL STAND-IN for InfluxDB 2 (no InfluxDB 2 server can run
here, docs/infra.md §2): a tiny HTTP server that answers POST /api/v2/query with annotated
CSV shaped as InfluxDB documents it (annotations #datatype, #group, #default; one table per
series). Writes are tested against real VictoriaMetrics in tests/integration."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from core.records import EntityId, EntityRef, NodeName
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
