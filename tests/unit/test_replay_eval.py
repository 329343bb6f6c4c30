"""The replay scorer (analytics/replay_score.py, which benchmarks/replay_eval.py and
`gpuhealth evaluate stream` use) on hand-made warnings and labels, and a tiny run of the
held-out generator (benchmarks/heldout_fleet.py) read back with the project's line-protocol
decoder. No replay child process is started here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from analytics import replay_score
from analytics.replay_score import AliasMap, Label, Truth, Warning, score
from benchmarks import heldout_fleet
from core.records import Event, Sample
from storage.lineprotocol import DecodeReport, read_records

Tiny = tuple[dict[str, Any], list[Sample], list[Event]]
H = 3600.0
T0 = 1_788_739_200.0
UUID = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
OTHER = "GPU-ffffffff-0000-1111-2222-333344445555"


def _truth(labels: list[Label], *, gpu_days: float = 100.0) -> Truth:
    aliases = AliasMap()
    aliases.add("n1", [UUID, "0000:18:00.0", "00000000:18:00.0", "gpu:0", "serial:1650000000001",
                       "1650000000001"], UUID.lower(), "gpu")
    aliases.add("n1", [OTHER, "0000:2a:00.0", "gpu:1"], OTHER.lower(), "gpu")
    aliases.add("n1", ["mlx5_0:1"], "mlx5_0:1", "port")
    return Truth(labels=labels, aliases=aliases, start=T0, end=T0 + 10 * 24 * H,
                 gpu_days=gpu_days, gpus=10)


def _dbe(at: float, *, onset: float | None = None, recovered: float | None = None) -> Label:
    return Label(id="F1", kind="dbe", node="n1", entity=UUID.lower(), at=at, onset=onset,
                 recovered_at=recovered)


def test_a_true_episode_gives_recall_and_lead() -> None:
    fail = T0 + 48 * H
    warnings = [Warning(node="n1", names=(UUID,), at=fail - 5 * H + i * 1800) for i in range(6)]
    result = score(warnings, _truth([_dbe(fail, onset=fail - 10 * H)]))
    o = result["overall"]
    assert (o["episodes"], o["true_episodes"], o["false_episodes"]) == (1, 1, 0)
    assert o["precision"] == 1.0
    assert o["recall"] == 1.0
    assert result["per_kind"]["dbe"]["median_lead_hours"] == pytest.approx(5.0)
    assert result["per_kind"]["dbe"]["precision"] == 1.0


def test_a_false_episode_counts_against_precision_and_the_rate() -> None:
    fail = T0 + 48 * H
    warnings = [Warning(node="n1", names=(UUID,), at=fail - 2 * H),
                Warning(node="n1", names=(OTHER,), at=fail - 30 * H, hint="dbe"),
                Warning(node="n1", names=(OTHER,), at=fail - 29.5 * H, hint="dbe"),  # same one
                Warning(node="n1", names=("mlx5_0:1",), at=fail - 3 * H)]
    result = score(warnings, _truth([_dbe(fail, onset=fail - 10 * H)], gpu_days=200.0))
    o = result["overall"]
    assert (o["true_episodes"], o["false_episodes"]) == (1, 2)
    assert o["precision"] == pytest.approx(1 / 3)
    assert o["false_per_1000_gpu_days"] == pytest.approx(10.0)
    # per kind: the GPU's false episode is attributed to dbe, the port's to link_down
    assert result["per_kind"]["dbe"]["false_episodes_attributed"] == 1
    assert result["per_kind"]["dbe"]["precision"] == pytest.approx(0.5)
    assert result["per_type"]["port"] == {"true_episodes": 0, "false_episodes": 1,
                                          "precision": 0.0}


def test_any_alias_of_the_entity_matches() -> None:
    fail = T0 + 48 * H
    labels = [_dbe(fail, onset=fail - 10 * H)]
    for names in (("00000000:18:00.0",), ("PCI:0000:18:00",), ("gpu:0",), ("1650000000001",),
                  ("unknown-name", "serial:1650000000001"), (UUID.upper(),)):
        result = score([Warning(node="n1", names=names, at=fail - 3 * H)], _truth(labels))
        assert result["overall"]["true_episodes"] == 1, names
    # the same PCI bus id on another node is another GPU
    result = score([Warning(node="n2", names=("0000:18:00.0",), at=fail - 3 * H)],
                   _truth(labels))
    assert result["overall"]["false_episodes"] == 1


def test_warnings_after_a_failure_until_recovery_are_ignored() -> None:
    fail = T0 + 48 * H
    labels = [_dbe(fail, recovered=fail + 10 * H)]
    warnings = [Warning(node="n1", names=(UUID,), at=fail + 5 * 60),  # late: lead < 0
                Warning(node="n1", names=(UUID,), at=fail + 1 * H),
                Warning(node="n1", names=(UUID,), at=fail + 9 * H),
                Warning(node="n1", names=(UUID,), at=fail + 12 * H)]  # after recovery
    result = score(warnings, _truth(labels))
    o = result["overall"]
    assert o["ignored_warnings"] == 2
    assert (o["true_episodes"], o["false_episodes"]) == (1, 1)
    assert result["failures"][0]["lead_hours"] == pytest.approx(-5 / 60)
    # never recovered: ignored to the end
    result = score(warnings, _truth([_dbe(fail)]))
    assert result["overall"]["ignored_warnings"] == 3
    assert result["overall"]["false_episodes"] == 0


def test_an_episode_starts_anew_where_the_window_opens() -> None:
    fail = T0 + 72 * H
    warnings = [Warning(node="n1", names=(UUID,), at=fail - 30 * H + i * 1800) for i in range(58)]
    result = score(warnings, _truth([_dbe(fail, onset=fail - 40 * H)]))
    o = result["overall"]
    assert (o["true_episodes"], o["false_episodes"]) == (1, 1)
    assert result["per_kind"]["dbe"]["median_lead_hours"] == pytest.approx(24.0)
    # one episode well before the window does not match at all
    early = [Warning(node="n1", names=(UUID,), at=fail - 26 * H)]
    assert score(early, _truth([_dbe(fail)]))["overall"]["true_episodes"] == 0


def test_node_level_warnings_are_counted_apart() -> None:
    result = score([Warning(node="n1", names=("node",), at=T0 + H)], _truth([]))
    assert result["overall"]["node_level_warnings"] == 1
    assert result["overall"]["episodes"] == 0


def test_a_replaced_gpu_resolves_by_time() -> None:
    aliases = AliasMap()
    aliases.add("n1", ["GPU-old", "0000:18:00.0"], "gpu-old", "gpu", valid_to=T0 + 50 * H)
    aliases.add("n1", ["GPU-new", "0000:18:00.0"], "gpu-new", "gpu", valid_from=T0 + 50 * H)
    assert aliases.resolve("n1", ["00000000:18:00.0"], T0 + 10 * H) == "gpu-old"
    assert aliases.resolve("n1", ["00000000:18:00.0"], T0 + 60 * H) == "gpu-new"


def test_warnings_are_read_from_the_replay_json() -> None:
    replay = {
        "analytics": {
            "predictions": [
                {"node": "n1", "entity": "0000:18:00.0", "aliases": [UUID], "probability": 0.95,
                 "predicted_at": T0 + H, "top_features": {"ecc_corrected_rate_6h": 2.0,
                                                          "temperature_dev": -0.5}},
                {"node": "n1", "entity": OTHER, "probability": 0.6, "predicted_at": T0 + 2 * H,
                 "top_features": {"temperature_dev": 1.5}},
            ],
            "anomalies_listed": [{"kind": "telemetry_gap", "detector": "gaps", "metric": None,
                                  "node": "n1", "entity": "node", "observed_at": T0}],
        },
        "nodes": [{"node": "n1", "findings_seen": [
            {"node": "n1", "entity": "0000:18:00.0", "kind": "xid", "code": "48",
             "severity": "critical", "first_seen_at": T0 + 3 * H},
            {"node": "n1", "entity": "mlx5_0:1", "kind": "ib_port", "code": "port_errors",
             "severity": "warning", "first_seen_at": T0 + 4 * H}]}],
    }
    high = replay_score.prediction_warnings(replay, 0.9)
    assert [(w.names, w.hint) for w in high] == [(("0000:18:00.0", UUID), "dbe")]
    assert [w.hint for w in replay_score.prediction_warnings(replay, 0.5)] == ["dbe", "thermal"]
    assert list(replay_score.anomaly_warnings(replay)) == ["telemetry_gap gaps"]
    assert len(replay_score.finding_warnings(replay, "warning")) == 2
    assert [w.hint for w in replay_score.finding_warnings(replay, "critical")] == ["dbe"]
    truth = _truth([_dbe(T0 + 5 * H, onset=T0)])
    result = replay_score.evaluate(replay, truth)
    assert result["scores"]["predictions>=0.9"]["overall"]["true_episodes"] == 1
    assert result["scores"]["findings>=critical"]["overall"]["true_episodes"] == 1


# --- the generator -------------------------------------------------------------------------

TINY = heldout_fleet.FleetConfig(gpus=16, days=0.2, quiet_hours=0.5,
                                 failures_per_1000_gpu_days=3000.0, chunk_ticks=100)


def test_the_plan_is_seeded() -> None:
    a = heldout_fleet.labels(heldout_fleet.plan_fleet(TINY, seed=4))
    b = heldout_fleet.labels(heldout_fleet.plan_fleet(TINY, seed=4))
    c = heldout_fleet.labels(heldout_fleet.plan_fleet(TINY, seed=5))
    assert a == b
    assert a["failures"] != c["failures"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    out = tmp_path_factory.mktemp("heldout")
    labels = heldout_fleet.generate(TINY, seed=4, out_dir=out)
    report = DecodeReport()
    records = list(read_records([out / "fleet.lp"], report=report))
    assert not report.skipped, report.problems
    assert (Path(out) / "labels.json").exists()
    samples = [r for r in records if isinstance(r, Sample)]
    events = [r for r in records if isinstance(r, Event)]
    return labels, samples, events


def test_labels_name_every_alias_and_time(tiny: Tiny) -> None:
    labels, _, _ = tiny
    kinds = {f["kind"] for f in labels["failures"]}
    assert kinds == {"dbe", "thermal", "otb", "link_down"}
    assert (labels["gpus"], labels["nodes"], labels["gpu_days"]) == (16, 2, 3.2)
    for f in labels["failures"]:
        assert labels["start"] < f["failure_at"] < labels["end"]
        if f["kind"] == "link_down":
            assert f["aliases"] == [f["entity"]]
            assert f["entity"].endswith(":1")
        else:
            uuid, pci, pci_nvml, index, serial, bare = f["aliases"]
            assert uuid == f["entity"]
            assert uuid.startswith("GPU-")
            assert pci == f["pci_bus_id"]
            assert pci_nvml == "0000" + pci.upper()[:-1] + "0"
            assert index.startswith("gpu:")
            assert serial == f"serial:{bare}"
        if f["kind"] == "otb":
            assert f["precursor_onset_at"] is None
        if f["kind"] == "thermal":
            assert f["precursor_onset_at"] is not None
        if f["precursor_onset_at"] is not None:
            assert f["precursor_onset_at"] < f["failure_at"]
    assert labels["summary"]["failures"] == len(labels["failures"])
    assert labels["confounders"]


def test_the_recording_is_shaped_as_the_collectors_write(
        tiny: Tiny) -> None:
    labels, samples, events = tiny
    uuids = {g["uuid"] for g in labels["entities"]["gpus"]}
    ports = {p["entity"] for p in labels["entities"]["ports"]}
    metrics = {s.metric for s in samples}
    assert {"gpu_info", "gpu_temperature_celsius", "gpu_power_watts", "gpu_utilization_ratio",
            "gpu_ecc_errors_total", "gpu_pcie_replays_total", "gpu_clock_event_active",
            "ib_port_state", "ib_symbol_errors_total", "ib_link_error_recovery_total",
            "ib_link_downed_total", "gpu_temperature_threshold_celsius"} <= metrics
    for s in samples:
        if s.metric.startswith("gpu_"):
            assert s.entity in uuids
        else:
            assert s.entity in ports
            assert s.labels == {"device": s.entity.split(":")[0], "port": "1"}
    info = [s for s in samples if s.metric == "gpu_info"]
    assert {"uuid", "serial", "model", "pci_bus_id", "index"} <= set(info[0].labels)
    assert info[0].labels["pci_bus_id"].startswith("00000000:")
    threshold_nodes = {s.node for s in samples if s.metric == "gpu_temperature_threshold_celsius"}
    assert len(threshold_nodes) == 1  # half of the two nodes
    ecc = {tuple(sorted(s.labels.items())) for s in samples if s.metric == "gpu_ecc_errors_total"}
    assert (("location", "total"), ("scope", "volatile"), ("type", "corrected")) in ecc
    xids = [e for e in events if e.kind == "xid"]
    assert xids
    assert all(e.entity.count(":") == 2 and e.entity.endswith(".0") for e in xids)
    assert all(e.source == "kernel_log" and e.evidence for e in xids)
    assert any(e.kind == "ib_port_state" and e.code == "down" for e in events)
    times = [s.observed_at or 0.0 for s in samples] + [e.observed_at or 0.0 for e in events]
    assert min(times) >= labels["start"]
    assert max(times) < labels["end"]


def test_each_failure_shows_in_the_recording(tiny: Tiny) -> None:
    labels, samples, events = tiny
    series: dict[tuple[str, str, str, str], list[tuple[float, float]]] = defaultdict(list)
    for s in samples:
        which = s.labels.get("type", "") + s.labels.get("scope", "")
        series[(s.node, s.entity, s.metric, which)].append((s.observed_at or 0.0, s.value))
    xid = {(e.node, e.entity, e.code) for e in events if e.kind == "xid"}
    for f in labels["failures"]:
        at, node = f["failure_at"], f["node"]
        if f["kind"] == "dbe":
            assert (node, f["pci_bus_id"], "48") in xid
            unc = series[(node, f["entity"], "gpu_ecc_errors_total", "uncorrectedvolatile")]
            before = [v for t, v in unc if t < at]
            after = [v for t, v in unc if at <= t < at + 3600]
            assert not before or before[-1] == 0.0
            assert after
            assert after[0] >= 1.0
        elif f["kind"] in ("otb", "thermal"):
            assert (node, f["pci_bus_id"], "79") in xid
            temps = series[(node, f["entity"], "gpu_temperature_celsius", "")]
            gone_until = f["recovered_at"] or math.inf
            assert not [t for t, _ in temps if at <= t < gone_until]
            if f["kind"] == "thermal":  # it dropped out at (or near) its shutdown temperature
                assert [v for t, v in temps if t < at][-1] >= 88.0
        else:
            state = series[(node, f["entity"], "ib_port_state", "")]
            assert [v for t, v in state if t == at] in ([1.0], [])
            downed = series[(node, f["entity"], "ib_link_downed_total", "")]
            assert any(v >= 1.0 for t, v in downed if t >= at)


def test_false_episodes_are_explained_by_the_held_out_labels() -> None:
    fail = T0 + 80 * H
    labels_json = {
        "failures": [{"node": "n1", "entity": UUID, "failure_at": fail,
                      "precursor_onset_at": fail - 60 * H, "recovered_at": fail + 5 * H}],
        "confounders": [
            {"kind": "always_warmer", "node": "n1", "entity": OTHER, "start": T0, "end": T0},
            {"kind": "collector_gap", "node": "n2", "entity": "node", "start": T0 + 10 * H,
             "end": T0 + 10.5 * H}],
    }
    warnings = [Warning(node="n1", names=(UUID,), at=fail - 40 * H),  # precursor, too early
                Warning(node="n1", names=(UUID,), at=fail + 8 * H),  # after the recovery
                Warning(node="n1", names=(OTHER,), at=T0 + 30 * H),  # steady confounder
                Warning(node="n2", names=("GPU-x",), at=T0 + 11 * H),  # node-level gap
                Warning(node="n2", names=("GPU-y",), at=T0 + 40 * H)]  # nothing known
    result = score(warnings, _truth([_dbe(fail, onset=fail - 60 * H, recovered=fail + 5 * H)]))
    replay_score.explain_false(result, labels_json)
    assert result["false_causes"] == {"precursor_before_window": 1, "after_recovery": 1,
                                      "always_warmer": 1, "node:collector_gap": 1, "none": 1}
