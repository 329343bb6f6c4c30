from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest

from core.records import NODE_ENTITY, AuditRecord, EntityId, NodeName, RemediationStep
from remediation.audit import AuditLog, audit_from_json, audit_to_json, read_audit_log


def record(i: int = 0, **kw: Any) -> AuditRecord:
    base: dict[str, Any] = {
        "at": 1000.0 + i,
        "actor": "gpuhealth",
        "decision": "requested",
        "step": RemediationStep.CORDON,
        "node": NodeName("gpu-001"),
        "entity": NODE_ENTITY,
        "reason": "gpuhealth: GpuXid79 critical reboot_node on 0000:b1:00.0",
        "idempotency_key": f"fp/cordon{i}",
        "dry_run": True,
        "details": {"fingerprint": "fp", "when": "now"},
    }
    base.update(kw)
    return AuditRecord(**base)


def test_round_trip_one_json_object_per_line(tmp_path):
    path = tmp_path / "deep" / "folder" / "audit.jsonl"
    log = AuditLog(path=str(path))
    assert log.read() == []
    log.append(record(0))
    log.extend([record(1, decision="held", step=None, entity=EntityId("gpu:1")), record(2)])
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["decision"] == "requested"
    assert first["step"] == "cordon"
    assert first["details"] == {"fingerprint": "fp", "when": "now"}
    assert set(first) == {
        "at",
        "actor",
        "decision",
        "step",
        "node",
        "entity",
        "reason",
        "idempotency_key",
        "dry_run",
        "details",
    }
    assert log.read() == [
        record(0),
        record(1, decision="held", step=None, entity=EntityId("gpu:1")),
        record(2),
    ]


def test_append_only_across_instances(tmp_path):
    path = str(tmp_path / "audit.jsonl")
    AuditLog(path=path).append(record(0))
    AuditLog(path=path).append(record(1))
    assert [r.at for r in read_audit_log(path)] == [1000.0, 1001.0]


def test_each_write_is_fsynced(tmp_path, monkeypatch):
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log = AuditLog(path=str(tmp_path / "a.jsonl"))
    log.append(record(0))
    log.append(record(1))
    log.extend([])
    assert len(calls) == 2


def test_truncated_last_line_is_skipped(tmp_path, caplog):
    path = tmp_path / "a.jsonl"
    AuditLog(path=str(path)).append(record(0))
    with path.open("a") as handle:
        handle.write('{"at": 1001.0, "actor": "gpuh')
    with caplog.at_level(logging.WARNING, logger="remediation.audit"):
        assert read_audit_log(str(path)) == [record(0)]
    assert "a.jsonl:2" in caplog.text


def test_json_helpers_round_trip():
    r = record(3)
    assert audit_from_json(json.loads(json.dumps(audit_to_json(r)))) == r


def test_empty_path_rejected():
    with pytest.raises(ValueError, match="must not be empty"):
        AuditLog(path="")
