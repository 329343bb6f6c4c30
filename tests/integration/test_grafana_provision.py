"""Provisioning dashboards through Grafana's HTTP API, against a local STAND-IN.

No Grafana server can be installed or run in this environment (architecture.md,
principle 6), so :class:`GrafanaStandIn` is a fake: an ``http.server`` on 127.0.0.1 in a
thread that follows Grafana's documented folder and dashboard API
(grafana/grafana docs/sources/developers/http_api/folder.md and dashboard.md;
ecosystem-reference §8.3):

* ``GET /api/folders/:uid`` 200 or 404; ``POST /api/folders`` 200, 409 on an existing uid.
* ``GET /api/dashboards/uid/:uid`` 200 ``{dashboard, meta}`` or 404.
* ``POST /api/dashboards/db`` ``{dashboard, folderUid, message, overwrite}``: 200
  ``{id, uid, url, status, version, slug}``; 412 ``version-mismatch`` when the posted
  version is not the stored one and ``overwrite`` is false; 412 ``name-exists`` when
  another dashboard in the folder has the same title; 400 for an unknown folder.
* ``Authorization: Bearer`` required: 401 without a valid token, 403 for a viewer token.

It is not Grafana: behaviour beyond these documented shapes is not reproduced.

The last test runs the Prometheus flavour's queries on a real Prometheus (started from
the ``prometheus`` binary like the other server-backed tests; skipped without it unless
``GPUHEALTH_TEST_SERVERS=required``).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from core.catalog import CATALOG
from core.records import EntityId, NodeName, Sample
from dashboards.grafana import (
    GrafanaAuthError,
    GrafanaConflict,
    GrafanaNotFound,
    GrafanaPermissionError,
    GrafanaProvisioner,
    GrafanaUnavailable,
    provision,
)
from dashboards.render import Flavour, folder_uid, render_all
from gpuhealth.metrics import MetricsExporter
from tests.servers import eventually, get_json, start_prometheus

EDITOR_TOKEN = "glsa_editor"
VIEWER_TOKEN = "glsa_viewer"


class GrafanaStandIn(ThreadingHTTPServer):
    """In-memory stand-in for Grafana's folder and dashboard HTTP API (not Grafana)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}  # uid -> {dashboard, folderUid}
        self.requests: list[tuple[str, str]] = []
        self.concurrent_edits = 0
        """Before each of the next N dashboard POSTs, someone else saves that dashboard."""
        self.next_id = 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def save_as_someone_else(self, uid: str) -> None:
        entry = self.dashboards[uid]
        entry["dashboard"] = dict(entry["dashboard"], version=entry["dashboard"]["version"] + 1,
                                  description="edited in the UI")


class _Handler(BaseHTTPRequestHandler):
    server: GrafanaStandIn

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _auth(self, write: bool) -> bool:
        header = self.headers.get("Authorization", "")
        if header not in (f"Bearer {EDITOR_TOKEN}", f"Bearer {VIEWER_TOKEN}"):
            self._reply(401, {"message": "Unauthorized"})
            return False
        if write and header == f"Bearer {VIEWER_TOKEN}":
            self._reply(403, {"message": "Access denied"})
            return False
        return True

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length", "0"))
        return json.loads(self.rfile.read(length) or b"null")

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path))
        if not self._auth(write=False):
            return
        with self.server.lock:
            if m := re.fullmatch(r"/api/folders/([^/]+)", self.path):
                folder = self.server.folders.get(m[1])
                if folder is None:
                    self._reply(404, {"message": "folder not found", "status": "not-found"})
                else:
                    self._reply(200, folder)
            elif m := re.fullmatch(r"/api/dashboards/uid/([^/]+)", self.path):
                entry = self.server.dashboards.get(m[1])
                if entry is None:
                    self._reply(404, {"message": "Dashboard not found"})
                else:
                    dash = entry["dashboard"]
                    self._reply(200, {"dashboard": dash, "meta": {
                        "folderUid": entry["folderUid"], "version": dash["version"],
                        "url": f"/d/{dash['uid']}/x", "slug": "x", "provisioned": False}})
            else:
                self._reply(404, {"message": "Not found"})

    def do_POST(self) -> None:
        self.server.requests.append(("POST", self.path))
        if not self._auth(write=True):
            return
        body = self._body()
        with self.server.lock:
            if self.path == "/api/folders":
                uid = body.get("uid") or f"f{len(self.server.folders)}"
                if uid in self.server.folders:
                    self._reply(409, {"message": "a folder with the same uid already exists"})
                    return
                folder = {"id": len(self.server.folders) + 1, "uid": uid,
                          "title": body["title"], "url": f"/dashboards/f/{uid}/", "version": 1}
                self.server.folders[uid] = folder
                self._reply(200, folder)
            elif self.path == "/api/dashboards/db":
                self._save_dashboard(body)
            else:
                self._reply(404, {"message": "Not found"})

    def _save_dashboard(self, body: dict[str, Any]) -> None:
        server = self.server
        dash = dict(body["dashboard"])
        uid, folder = str(dash.get("uid")), str(body.get("folderUid", ""))
        if folder and folder not in server.folders:
            self._reply(400, {"message": "folder not found"})
            return
        if server.concurrent_edits and uid in server.dashboards:
            server.concurrent_edits -= 1
            server.save_as_someone_else(uid)
        stored = server.dashboards.get(uid)
        overwrite = bool(body.get("overwrite"))
        for other_uid, entry in server.dashboards.items():
            if (other_uid != uid and entry["folderUid"] == folder
                    and entry["dashboard"]["title"] == dash["title"] and not overwrite):
                self._reply(412, {"message": "A dashboard with the same name in the folder "
                                  "already exists", "status": "name-exists"})
                return
        if stored is not None and not overwrite and (
                dash.get("version") != stored["dashboard"]["version"]):
            self._reply(412, {"message": "The dashboard has been changed by someone else",
                              "status": "version-mismatch"})
            return
        if stored is None:
            dash["id"], dash["version"] = server.next_id, 1
            server.next_id += 1
        else:
            dash["id"] = stored["dashboard"]["id"]
            dash["version"] = stored["dashboard"]["version"] + 1
        server.dashboards[uid] = {"dashboard": dash, "folderUid": folder}
        self._reply(200, {"id": dash["id"], "uid": uid, "url": f"/d/{uid}/x",
                          "status": "success", "version": dash["version"], "slug": "x"})


@pytest.fixture
def grafana() -> Iterator[GrafanaStandIn]:
    server = GrafanaStandIn()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_provisions_folder_and_every_dashboard(grafana: GrafanaStandIn) -> None:
    results = provision(grafana.url, token=EDITOR_TOKEN, folder="GPU Health",
                        flavours=tuple(Flavour))
    expected = {d["uid"] for f in Flavour for d in render_all(f).values()}
    assert {r.uid for r in results} == expected
    assert {r.status for r in results} == {"created"}
    assert grafana.folders[folder_uid("GPU Health")]["title"] == "GPU Health"
    for uid in expected:
        assert grafana.dashboards[uid]["folderUid"] == folder_uid("GPU Health")
    # Same content again: nothing is saved, no new versions.
    posts = sum(1 for method, _ in grafana.requests if method == "POST")
    again = provision(grafana.url, token=EDITOR_TOKEN, folder="GPU Health",
                      flavours=tuple(Flavour))
    assert {r.status for r in again} == {"unchanged"}
    assert sum(1 for method, _ in grafana.requests if method == "POST") == posts


def test_changed_dashboard_is_replaced_on_the_stored_version(grafana: GrafanaStandIn) -> None:
    provisioner = GrafanaProvisioner(url=grafana.url, token=EDITOR_TOKEN)
    folder = provisioner.ensure_folder("GPU Health")
    dashboard = render_all(Flavour.PROMETHEUS)["gpu"]
    provisioner.save_dashboard(dashboard, folder_uid=folder)
    grafana.save_as_someone_else(dashboard["uid"])  # an edit in the UI: version 2
    result = provisioner.save_dashboard(dashboard, folder_uid=folder)
    assert (result.status, result.version, result.attempts) == ("updated", 3, 1)
    stored = grafana.dashboards[dashboard["uid"]]["dashboard"]
    assert stored["description"] == dashboard["description"]


def test_412_version_mismatch_is_retried_after_reading_again(grafana: GrafanaStandIn) -> None:
    provisioner = GrafanaProvisioner(url=grafana.url, token=EDITOR_TOKEN, max_attempts=3)
    folder = provisioner.ensure_folder("GPU Health")
    dashboard = render_all(Flavour.PROMETHEUS)["node"]
    provisioner.save_dashboard(dashboard, folder_uid=folder)
    grafana.save_as_someone_else(dashboard["uid"])
    grafana.concurrent_edits = 2  # two saves race ours
    result = provisioner.save_dashboard(dashboard, folder_uid=folder)
    assert result.status == "updated"
    assert result.attempts == 3
    assert grafana.dashboards[dashboard["uid"]]["dashboard"]["description"] == (
        dashboard["description"])


def test_412_that_keeps_coming_is_a_conflict(grafana: GrafanaStandIn) -> None:
    provisioner = GrafanaProvisioner(url=grafana.url, token=EDITOR_TOKEN, max_attempts=2)
    folder = provisioner.ensure_folder("GPU Health")
    dashboard = render_all(Flavour.PROMETHEUS)["node"]
    provisioner.save_dashboard(dashboard, folder_uid=folder)
    grafana.save_as_someone_else(dashboard["uid"])
    grafana.concurrent_edits = 5
    with pytest.raises(GrafanaConflict, match="version-mismatch 2 times"):
        provisioner.save_dashboard(dashboard, folder_uid=folder)


def test_412_name_exists_is_not_retried(grafana: GrafanaStandIn) -> None:
    provisioner = GrafanaProvisioner(url=grafana.url, token=EDITOR_TOKEN)
    folder = provisioner.ensure_folder("GPU Health")
    dashboard = render_all(Flavour.PROMETHEUS)["gpu"]
    provisioner.save_dashboard(dict(dashboard, uid="someone-elses-uid"), folder_uid=folder)
    with pytest.raises(GrafanaConflict, match="name-exists"):
        provisioner.save_dashboard(dashboard, folder_uid=folder)


def test_401_without_valid_token(grafana: GrafanaStandIn) -> None:
    with pytest.raises(GrafanaAuthError, match=r"401.*--token-env"):
        provision(grafana.url, token="wrong")
    with pytest.raises(GrafanaAuthError):
        provision(grafana.url, token=None)


def test_403_for_a_token_without_write_rights(grafana: GrafanaStandIn) -> None:
    with pytest.raises(GrafanaPermissionError, match=r"403.*Editor"):
        provision(grafana.url, token=VIEWER_TOKEN)


def test_404_when_the_url_is_not_grafanas_api_root(grafana: GrafanaStandIn) -> None:
    with pytest.raises(GrafanaNotFound, match="404"):
        provision(f"{grafana.url}/not-grafana", token=EDITOR_TOKEN)


def test_unreachable_grafana_is_temporary() -> None:
    server = GrafanaStandIn()  # bound, never served, then closed: the port refuses
    url = server.url
    server.server_close()
    with pytest.raises(GrafanaUnavailable):
        provision(url, token=EDITOR_TOKEN, timeout_seconds=2.0)


# --- the Prometheus flavour's queries against a REAL Prometheus ---------------------------
#
# Grafana itself cannot run here, but Prometheus can (docs/infra.md §3): it scrapes
# gpuhealth's own /metrics rendering (GPU-A on n1) plus dcgm-exporter series (GPU-B on n2,
# and a conflicting GPU-A value that gpuhealth's must win over). Every panel, variable and
# annotation query, with Grafana's variables substituted as Grafana would for "All",
# must parse and run, and the dcgm-exporter fallback must come back relabelled and scaled.

_DCGM_LINES = (
    b'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-B",Hostname="n2"} 70\n'
    b'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-A",Hostname="n1"} 99\n'
    b'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-B",Hostname="n2"} 50\n'
    b'DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-B",Hostname="n2"} 1410\n'
    b'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-B",Hostname="n2"} 79\n'
)


def _grafana_all(expr: str) -> str:
    """Substitute Grafana's variables the way Grafana does with "All" (allValue .*)."""
    for name, value in (("$dcgm_host_label", "Hostname"), ("$__rate_interval", "1m"),
                        ("$cluster", ".*"), ("$node", ".*"), ("$gpu", ".*")):
        expr = expr.replace(name, value)
    if expr.startswith("query_result(") and expr.endswith(")"):
        expr = expr[len("query_result("):-1]
    return expr


@pytest.fixture
def gpuhealth_scrape() -> Iterator[str]:
    values = {"gpu_temperature_celsius": 60.0, "gpu_utilization_ratio": 0.25,
              "gpuhealth_disrupted_nodes": 1.0, "gpuhealth_disruption_budget_nodes": 4.0,
              "gpu_failure_probability_ratio": 0.7}
    exporter = MetricsExporter()
    samples = []
    for spec in CATALOG:
        labels = dict.fromkeys(spec.labels, "x")
        value = values.get(spec.name, 1.0)
        if spec.name.startswith("gpuhealth_"):
            exporter.set(spec.name, value, labels)
        else:
            samples.append(Sample(metric=spec.name, value=value, observed_at=None,
                                  node=NodeName("n1"), entity=EntityId("GPU-A"), labels=labels))
    exporter.update(samples)
    body = exporter.render() + _DCGM_LINES

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_prometheus_flavour_queries_run_on_real_prometheus(
        tmp_path: Path, gpuhealth_scrape: str) -> None:
    def query(prom_url: str, expr: str) -> list[dict[str, Any]]:
        answer = get_json(f"{prom_url}/api/v1/query?"
                          + urllib.parse.urlencode({"query": _grafana_all(expr)}))
        assert answer["status"] == "success", (expr, answer)
        return list(answer["data"]["result"])

    rules = tmp_path / "rules.yml"
    rules.write_text("groups: []\n")
    dashboards = render_all(Flavour.PROMETHEUS)
    with start_prometheus(rules_file=rules, scrape_target=gpuhealth_scrape) as prom:
        eventually(lambda: query(prom.url, 'gpu_info{cluster=~"$cluster"}'), timeout=30,
                   interval=0.2)
        for dashboard in dashboards.values():
            texts = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
            texts += [v["query"] for v in dashboard["templating"]["list"]
                      if v["type"] == "query"]
            texts += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
            for text in texts:
                query(prom.url, text)  # parses and runs

        gpu = {p["title"]: [t["expr"] for t in p["targets"]]
               for p in dashboards["gpu"]["panels"]}
        temps = {(r["metric"]["node"], r["metric"]["entity"]): float(r["value"][1])
                 for r in query(prom.url, gpu["Temperatures"][0])}
        assert temps == {("n1", "GPU-A"): 60.0, ("n2", "GPU-B"): 70.0}  # gpuhealth wins
        util = {r["metric"]["entity"]: float(r["value"][1])
                for r in query(prom.url, gpu["Utilization"][0])}
        assert util == {"GPU-A": 0.25, "GPU-B": 0.5}  # dcgm-exporter's % scaled to 0-1
        clocks = {r["metric"]["entity"]: float(r["value"][1])
                  for r in query(prom.url, gpu["Clocks"][0])}
        assert clocks["GPU-B"] == 1.41e9
        variables = {v["name"]: v["query"] for v in dashboards["gpu"]["templating"]["list"]}
        nodes = {r["metric"]["node"] for r in query(prom.url, variables["node"])}
        assert nodes == {"n1", "n2"}
        fleet = {p["title"]: [t["expr"] for t in p["targets"]]
                 for p in dashboards["fleet"]["panels"]}
        (budget,) = query(prom.url, fleet["Disruption budget in use"][0])
        assert float(budget["value"][1]) == 0.25
        (predicted,) = query(prom.url, fleet["GPUs predicted to fail (p > 0.5)"][0])
        assert float(predicted["value"][1]) == 1.0
        xid = next(a["expr"] for a in dashboards["gpu"]["annotations"]["list"]
                   if a["name"] == "Xid")
        assert query(prom.url, xid), "a new Xid series must be annotated"
