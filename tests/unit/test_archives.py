"""diagnose and replay open archives (issue #14 item 4): tar, tar.gz, tar.xz, zip.

The archives are built here from real case files of tests/fixtures/cases, laid out as a
sosreport lays out its logs.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from collectors.archive import members
from collectors.artifact import ParseIssue
from gpuhealth.diagnose import diagnose
from gpuhealth.replay import replay

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"
NCCL = CASES / "017-nccl-net-ib-completion-status12-vendor-err-129-roce.log"
XID79 = CASES / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"


def _tar(path: Path, mode: str, files: dict[str, bytes], *,
         links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path


def _zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def _summary(diagnosis) -> list[tuple[str, str, str, str]]:
    return sorted((f["node"], f["kind"], f["code"], f["severity"])
                  for f in diagnosis.to_json()["findings"])


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_tar_gz_bundle_gives_the_findings_of_its_member(here: Path) -> None:
    _tar(here / "sosreport-n1.tar.gz", "w:gz",
         {"sosreport-n1/var/log/nccl.log": NCCL.read_bytes()})
    alone = diagnose([str(NCCL)])
    bundled = diagnose(["sosreport-n1.tar.gz"])
    assert _summary(bundled) == _summary(alone)
    assert len(bundled.findings) == 1  # was two findings on two nodes
    assert bundled.exit_status == alone.exit_status
    out = bundled.to_json()
    assert out["errors"] == []  # was a note about NUL padding
    files = {e["file"] for f in out["findings"] for e in f["evidence"]}
    assert files == {"sosreport-n1.tar.gz:sosreport-n1/var/log/nccl.log"}
    lines = [e["line"] for f in out["findings"] for e in f["evidence"]]
    assert lines == [e["line"] for f in alone.to_json()["findings"] for e in f["evidence"]]


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "tar.xz", "tar.bz2", "zip"])
def test_every_member_of_every_kind_is_diagnosed(here: Path, kind: str) -> None:
    files = {
        "var/log/kern.log": XID79.read_bytes(),
        "var/log/nccl.log": NCCL.read_bytes(),
        "var/log/kern.log.1.gz": gzip.compress(XID79.read_bytes()),
        "var/log/wtmp": bytes(range(256)) * 8,  # binary: not an artifact, not an error
        "etc/empty.conf": b"",
        "etc/hostname": b"n1\n",
    }
    name = f"bundle.{kind}"
    if kind == "zip":
        _zip(here / name, files)
    else:
        mode = {"tar": "w", "tar.gz": "w:gz", "tar.xz": "w:xz", "tar.bz2": "w:bz2"}[kind]
        _tar(here / name, mode, files)
    bundled = diagnose([name])
    assert _summary(bundled) == sorted(set(_summary(diagnose([str(XID79)]))
                                           + _summary(diagnose([str(NCCL)]))))
    assert bundled.to_json()["errors"] == []
    files_named = {e["file"] for f in bundled.to_json()["findings"] for e in f["evidence"]}
    assert files_named <= {f"{name}:var/log/kern.log", f"{name}:var/log/nccl.log",
                           f"{name}:var/log/kern.log.1.gz"}
    assert f"{name}:var/log/nccl.log" in files_named


def test_a_gzip_of_text_stays_a_text_file(here: Path) -> None:
    (here / "nvidia-bug-report.log.gz").write_bytes(gzip.compress(XID79.read_bytes()))
    zipped = diagnose(["nvidia-bug-report.log.gz"])
    assert _summary(zipped) == _summary(diagnose([str(XID79)]))
    files = {e["file"] for f in zipped.to_json()["findings"] for e in f["evidence"]}
    assert files == {"nvidia-bug-report.log.gz"}


def test_unsafe_names_and_links_are_never_followed(here: Path) -> None:
    outside = here / "outside"
    outside.mkdir()
    os.chdir(outside)
    _tar(here / "evil.tar", "w", {"../../escaped.log": XID79.read_bytes(),
                                  "/etc/abs.log": XID79.read_bytes(),
                                  "logs/nccl.log": NCCL.read_bytes()},
         links={"logs/kern.log": str(XID79), "logs/up.log": "../../" + XID79.name})
    result = diagnose([str(here / "evil.tar")])
    assert _summary(result) == _summary(diagnose([str(NCCL)]))  # the Xid 79 never read
    reasons = [e["reason"] for e in result.to_json()["errors"]]
    assert len(reasons) == 2
    assert all("outside the archive" in r for r in reasons)
    assert sorted(p.name for p in here.rglob("*")) == ["evil.tar", "outside"]


def test_the_caps_stop_reading_and_say_so(here: Path) -> None:
    archive = _tar(here / "many.tar.gz", "w:gz",
                   {f"log/{i}.log": NCCL.read_bytes() for i in range(3)})
    issues: list[ParseIssue] = []
    assert len([m.name for m in members(str(archive), issues, max_members=2)]) == 2
    assert len(issues) == 1
    assert "2 members" in issues[0].reason
    issues.clear()
    size = len(NCCL.read_bytes())
    read = 0
    for member in members(str(archive), issues, max_total_bytes=size + 10):
        read += len(member.stream.read())
    assert read == size + 10
    assert len(issues) == 1
    assert f"{size + 10} decompressed bytes" in issues[0].reason


def test_a_cut_archive_keeps_what_was_read_and_says_it_is_cut(here: Path) -> None:
    whole = _tar(here / "whole.tar.gz", "w:gz", {"a/nccl.log": NCCL.read_bytes(),
                                                 "b/kern.log": XID79.read_bytes() * 20})
    (here / "cut.tar.gz").write_bytes(whole.read_bytes()[:-200])
    result = diagnose(["cut.tar.gz"])
    assert any(f.kind == "rdma_transport" for f in result.findings)
    errors = result.to_json()["errors"]
    assert errors
    assert all(e["file"].startswith("cut.tar.gz") for e in errors)


def test_replay_reads_the_bundle_as_one_snapshot_of_its_node(here: Path) -> None:
    _tar(here / "gpu-017.tar.gz", "w:gz", {"var/log/kern.log": XID79.read_bytes(),
                                           "var/log/nccl.log": NCCL.read_bytes()})
    report = replay(["gpu-017.tar.gz"], facts={"node": "gpu-017"})
    assert [n.node for n in report.nodes] == ["gpu-017"]
    node = report.nodes[0]
    assert node.files == ["gpu-017.tar.gz"]
    kinds = {f.kind for f in node.findings}
    assert "rdma_transport" in kinds
    evidence = {e.file for f in node.findings for e in f.evidence}
    assert evidence <= {"gpu-017.tar.gz:var/log/kern.log", "gpu-017.tar.gz:var/log/nccl.log"}
    assert not report.issues


def test_a_zip_link_is_not_followed(here: Path) -> None:
    with zipfile.ZipFile(here / "links.zip", "w") as archive:
        link = zipfile.ZipInfo("logs/kern.log")
        link.external_attr = (0o120777 << 16)  # a symbolic link, as Info-ZIP stores one
        archive.writestr(link, str(XID79))
        archive.writestr("logs/nccl.log", NCCL.read_bytes())
    assert _summary(diagnose(["links.zip"])) == _summary(diagnose([str(NCCL)]))
