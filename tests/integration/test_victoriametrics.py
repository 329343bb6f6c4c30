"""The influxdb store writes to a real VictoriaMetrics (InfluxDB v2 write API), and the
promql store reads it back, including dcgm-exporter series through the catalog."""

from __future__ import annotations

import time
import urllib.request

import pytest

from core.catalog import BY_NAME
from core.errors import PermanentError
from core.records import EntityId, EntityRef, Event, NodeName, Sample
from storage.influxdb import InfluxDbStore
from storage.promql import PromqlStore
from tests.vm_server import Server
from tests.vm_server import prometheus as prometheus  # fixture
from tests.vm_server import victoria_metrics as victoria_metrics  # fixture

NOW = float(int(time.time()) - 600)


def _wait_rows(server: Server, store: PromqlStore, metric: str, want: int, **kw):
    deadline = time.monotonic() + 10
    while True:
        server.flush()
        frame = store.read(metric, None, NOW - 3600, NOW + 3600, **kw)
        if len(frame) >= want or time.monotonic() > deadline:
            return frame
        time.sleep(0.2)


def test_write_with_influx_client_and_read_with_promql(victoria_metrics: Server) -> None:
    store = InfluxDbStore(url=victoria_metrics.url, org="o", bucket="fleet", token="x")
    samples = [
        Sample(metric="gpu_temperature_celsius", value=40.0 + i, observed_at=NOW + i,
               node=NodeName("node 01"), entity=EntityId("GPU-a,b"), labels={})
        for i in range(20)
    ] + [
        Sample(metric="gpu_clock_event_active", value=1, observed_at=NOW,
               node=NodeName("n2"), entity=EntityId("GPU-c"), labels={"reason": 'hw "slow"'}),
        Sample(metric="gpu_temperature_celsius", value=float("nan"), observed_at=NOW,
               node=NodeName("n2"), entity=EntityId("GPU-c")),
        Sample(metric="gpu_temperature_celsius", value=1.0, observed_at=NOW + 86400 * 365,
               node=NodeName("n2"), entity=EntityId("GPU-c")),
    ]
    event = Event(kind="xid", code="79", node=NodeName("n2"), entity=EntityId("GPU-c"),
                  observed_at=NOW, message='fallen "off" the bus')
    store.write(samples, [event])
    store.close()
    assert dict(store.rejected) == {"nan": 1, "future": 1, "converted_type": 1}

    reader = PromqlStore(url=victoria_metrics.url)
    frame = _wait_rows(victoria_metrics, reader, "gpu_temperature_celsius", 20)
    assert frame["node"].unique().tolist() == ["node 01"]
    assert frame["entity"].unique().tolist() == ["GPU-a,b"]
    assert frame["observed_at"].tolist() == [NOW + i for i in range(20)]
    assert frame["value"].tolist() == [40.0 + i for i in range(20)]
    clocks = reader.read("gpu_clock_event_active", None, NOW - 10, NOW + 10)
    assert clocks[["reason", "value"]].values.tolist() == [['hw "slow"', 1.0]]
    stepped = reader.read("gpu_temperature_celsius",
                          [EntityRef(node=NodeName("node 01"), entity=EntityId("GPU-a,b"))],
                          NOW, NOW + 19, step_seconds=10)
    assert len(stepped) in (2, 3)
    assert EntityRef(node=NodeName("node 01"), entity=EntityId("GPU-a,b")) in reader.entities()
    events = reader.read("gpuhealth_event_count", None, NOW - 10, NOW + 10)
    assert events["value"].tolist() == [1.0]
    reader.close()


def test_import_streams_a_recording_through_the_spool_into_victoria_metrics(
        victoria_metrics: Server, tmp_path) -> None:
    # gpuhealth import: file -> checked batches -> spool -> write_stream (encoding the next
    # batch while one is posted) -> a real VictoriaMetrics; read back whole and in order
    from storage.lineprotocol import import_lines
    from storage.spool import SpoolingStore

    stamp = int(NOW) * 10**9
    lines = [f"gpu,node=n{g % 3},entity=GPU-{g} imported_temperature_celsius={g + i / 10},"
             f"imported_power_watts={300 + i} {stamp + i * 10**9}"
             for i in range(40) for g in range(30)]
    lines.insert(7, "gpu,node=n1,entity=GPU-x temperature_celsius=\"hot\" " + str(stamp))
    recording = tmp_path / "fleet.lp"
    recording.write_text("\n".join(lines) + "\n")
    store = InfluxDbStore(url=victoria_metrics.url, org="o", bucket="fleet", token="x")
    spool = SpoolingStore(store=store, path=tmp_path / "spool")
    report = import_lines(spool, [recording], batch_size=100)
    spool.close()
    assert (report.samples, dict(report.rejected)) == (2400, {"string_field": 1})
    assert spool.depth == 0
    reader = PromqlStore(url=victoria_metrics.url)
    frame = _wait_rows(victoria_metrics, reader, "gpu_imported_power_watts", 1200)
    assert len(frame) == 1200
    one = frame[frame["entity"] == "GPU-7"]
    assert one["observed_at"].tolist() == [NOW + i for i in range(40)]
    assert one["value"].tolist() == [300.0 + i for i in range(40)]
    reader.close()
    # reading back through the influxdb store fails (no Flux here) and says what to use
    with pytest.raises(PermanentError, match='type = "promql"'):
        InfluxDbStore(url=victoria_metrics.url, org="o", bucket="fleet", token="x").read(
            "gpu_imported_power_watts", None, NOW, NOW + 60)
    # ... and gpuhealth export with [storage] type = "promql" reads it back
    from click.testing import CliRunner

    from gpuhealth.cli import main

    config = tmp_path / "promql.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n'
                      f'[storage]\ntype = "promql"\nurl = "{victoria_metrics.url}"\n')
    result = CliRunner().invoke(main, ["export", "--config", str(config), "--since",
                                       str(NOW - 10), "--until", str(NOW + 60), "--metric",
                                       "gpu_imported_power_watts"])
    assert result.exit_code == 0, result.output
    lines = [x for x in result.stdout.splitlines() if not x.startswith("#")]
    assert len(lines) == 1200
    assert "exported 1200 samples" in result.stderr


def test_dcgm_exporter_series_are_read_through_the_catalog(victoria_metrics: Server) -> None:
    at_ms = int(NOW * 1000)
    body = (f'DCGM_FI_DEV_POWER_USAGE{{gpu="0",UUID="GPU-dcgm",Hostname="dgx1",'
            f'modelName="NVIDIA H100"}} 312.5 {at_ms}\n'
            f'DCGM_FI_DEV_FB_USED{{gpu="0",uuid="GPU-dcgm",hostname="dgx1"}} 2 {at_ms}\n')
    request = urllib.request.Request(victoria_metrics.url + "/api/v1/import/prometheus",
                                     data=body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 204
    reader = PromqlStore(url=victoria_metrics.url)
    power = _wait_rows(victoria_metrics, reader, "gpu_power_watts", 1)
    assert power[["node", "entity", "value"]].values.tolist() == [["dgx1", "GPU-dcgm", 312.5]]
    used = reader.read("gpu_memory_used_bytes",
                       [EntityRef(node=NodeName("dgx1"), entity=EntityId("GPU-dcgm"))],
                       NOW - 10, NOW + 10)
    assert used["value"].tolist() == [2 * BY_NAME["gpu_memory_used_bytes"].dcgm_scale]
    assert EntityRef(node=NodeName("dgx1"), entity=EntityId("GPU-dcgm")) in reader.entities()
    reader.close()


def test_unreachable_server_is_a_temporary_error() -> None:
    from core.errors import TemporaryError

    failures = []
    store = InfluxDbStore(url="http://127.0.0.1:9", org="o", bucket="b", token="x",
                          max_retries=0, on_error=lambda conf, body, exc: failures.append(conf))
    with pytest.raises(TemporaryError):
        store.write([Sample(metric="gpu_power_watts", value=1.0, observed_at=NOW,
                            node=NodeName("n"), entity=EntityId("g"))], [])
    assert failures == [("b", "o", "ms")]
    store.close()


def test_promql_reader_on_a_real_prometheus(prometheus: Server) -> None:
    reader = PromqlStore(url=prometheus.url)
    ref = EntityRef(node=NodeName("dgx9"), entity=EntityId("GPU-prom"))
    deadline = time.monotonic() + 15
    while True:
        now = time.time()
        power = reader.read("gpu_power_watts", [ref], now - 60, now)
        energy = reader.read("gpu_energy_joules_total", None, now - 60, now)
        if (len(power) >= 2 and len(energy) >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(power["value"]) == {250.5}
    assert power["observed_at"].is_monotonic_increasing
    assert energy[["node", "entity"]].drop_duplicates().values.tolist() == [["dgx9", "GPU-prom"]]
    assert set(energy["value"]) == {5000 * BY_NAME["gpu_energy_joules_total"].dcgm_scale}
    native = reader.read("gpu_temperature_celsius", [ref], now - 60, now, step_seconds=1)
    assert set(native["value"]) == {61.0}
    assert ref in reader.entities()
    reader.close()
