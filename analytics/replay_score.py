"""Score a replay's output against a labelled recording's failures (issue #15).

The input is what ``gpuhealth replay FILE.lp --json`` prints (:func:`gpuhealth.replay.to_json`:
predictions, anomalies, findings, alerts, each with an entity and a time) and the recording's
labels as a :class:`Truth`: from a held-out fleet's labels JSON (:func:`heldout_truth`,
``benchmarks/heldout_fleet.py``) or from the project's synthetic plan
(:func:`analytics.stream_eval.plan_truth`). ``gpuhealth evaluate stream`` and
``benchmarks/replay_eval.py`` score with :func:`evaluate` and print :func:`render_scores`.

**Scoring** (every time in epoch seconds):

* A warning is one record of the JSON with an entity and a time: a prediction with
  ``probability`` at or above the threshold (0.5 and 0.9; time ``predicted_at``), an
  anomaly of ``analytics.anomalies_listed`` (time ``observed_at``, scored per
  ``kind detector``), a finding of ``nodes[].findings_seen`` at or above a severity (time
  ``first_seen_at``), an alert of ``nodes[].alerts`` (time ``starts_at``).
* Entities are matched through every alias: the labels' (UUID, PCI bus id in any
  spelling, ``gpu:<index>``, ``serial:<serial>``, ``mlx5_N:1``), the prediction's own
  ``aliases`` and, for a recording with one, its ``gpu_info`` inventory
  (:func:`inventory_aliases`); always on the same node, and for a GPU replaced in its slot,
  the identity valid at the warning's time.
* Warnings of one entity from 15 min after a failure until its recovery (the end of the
  recording when it never recovered) are ignored.
* An episode is consecutive warnings of one entity less than 1 h apart; it also starts
  anew where a failure's 24-h window opens (a warning that began 30 h before a failure
  counts one false episode for its first 6 h and one true one from the window on).
* An episode matches a failure of its entity when it starts within 24 h before the
  failure or up to 15 min after it (the soonest such failure); it is then true, else
  false. Precision = true episodes / all episodes (node-level ones, entity ``node``,
  are counted apart and are neither). Recall per kind = failures with a matching
  episode / failures; median lead = failure time minus the first matching warning, over
  the detected failures that have a precursor; false episodes per 1,000 GPU-days over
  the whole fleet (ports included).
* Per kind, precision is true episodes of that kind over those plus the false episodes
  attributed to it: a port's to ``link_down``, a GPU's by what drove the warning (the
  prediction's strongest feature, the anomaly's metric, the finding's kind: ECC ->
  ``dbe``, temperature, power, throttling -> ``thermal``, PCIe, Xid 79, gaps -> ``otb``);
  a GPU false episode with no attribution counts against every GPU kind.

Goals (issue #15, :data:`GOALS`): per kind precision >= 0.85 at recall >= 0.5, median lead
>= 1 h on failures with precursors, <= 5 false episodes per 1,000 GPU-days.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.ids import normalize_pci_bus_id
from storage.lineprotocol import decode_line

HOUR = 3600.0
BEFORE_SECONDS = 24 * HOUR
"""A warning up to this long before a failure can match it."""
AFTER_SECONDS = 15 * 60.0
"""... and up to this long after it; later warnings until the recovery are ignored."""
EPISODE_GAP_SECONDS = HOUR
"""Warnings of one entity less than this apart are one episode."""
KINDS = ("dbe", "thermal", "otb", "link_down")
GPU_KINDS = ("dbe", "thermal", "otb")
GOALS = {"precision": 0.85, "recall": 0.5, "median_lead_hours": 1.0,
         "false_per_1000_gpu_days": 5.0}
"""Issue #15's goals, per failure kind."""
THRESHOLDS = (0.5, 0.9)
"""Prediction probabilities scored as warnings (at or above)."""
SEVERITIES = ("info", "warning", "major", "critical")
RULES: dict[str, Any] = {"episode_gap_seconds": EPISODE_GAP_SECONDS,
                         "window_before_seconds": BEFORE_SECONDS,
                         "after_seconds": AFTER_SECONDS, "goals": GOALS}
"""The scoring's parameters, as the JSON reports carry them."""


# --- identities ----------------------------------------------------------------------------


def normalise(alias: str) -> str:
    """One spelling per name: PCI bus ids canonical (``0000:b1:00.0``), the rest lower case.

    Examples:
        >>> normalise("00000000:1A:00.0"), normalise("PCI:0000:1a:00"), normalise("GPU-AB")
        ('0000:1a:00.0', '0000:1a:00.0', 'gpu-ab')
        >>> normalise("mlx5_3:1")
        'mlx5_3:1'
    """
    text = alias.strip()
    if text.count(":") >= 2:
        pci = normalize_pci_bus_id(text)
        if pci is not None:
            return pci
    return text.lower()


def entity_type(entity: str) -> str:
    """``gpu``, ``port`` or ``node`` for an entity the labels do not know.

    Examples:
        >>> entity_type("mlx5_0:1"), entity_type("GPU-1"), entity_type("node")
        ('port', 'gpu', 'node')
    """
    if entity in ("node", ""):
        return "node"
    if entity.count(":") == 1 and re.fullmatch(r"[\w.-]+:\w+", entity):
        return "port"
    return "gpu"


@dataclass
class AliasMap:
    """``(node, alias)`` -> the labelled entity (its key), valid over a time range."""

    names: dict[tuple[str, str], list[tuple[str, float, float]]] = field(
        default_factory=lambda: defaultdict(list))
    types: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, node: str, aliases: Iterable[str], key: str, kind: str, *,
            valid_from: float = -math.inf, valid_to: float = math.inf) -> None:
        """Register every alias of entity ``key`` (type ``kind``: gpu or port) on ``node``."""
        self.types[(node, key)] = kind
        for alias in {normalise(a) for a in aliases if a} | {key}:
            entries = self.names[(node, alias)]
            if (key, valid_from, valid_to) not in entries:
                entries.append((key, valid_from, valid_to))

    def resolve(self, node: str, names: Sequence[str], at: float) -> str:
        """The key of the first of ``names`` known on ``node`` (valid at ``at``), else the first.

        A name that several identities had (a PCI bus id whose GPU was replaced) resolves
        to the one valid at ``at``, else the first registered.
        """
        for name in names:
            entries = self.names.get((node, normalise(name)))
            if entries:
                for key, t0, t1 in entries:
                    if t0 <= at < t1:
                        return key
                return entries[0][0]
        return normalise(names[0]) if names else ""

    def type_of(self, node: str, key: str) -> str:
        """``gpu``, ``port`` or ``node``."""
        return self.types.get((node, key)) or entity_type(key)


# --- labels and warnings -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Label:
    """One failure: kind, node, entity key (labels' canonical name), times."""

    id: str
    kind: str
    node: str
    entity: str
    at: float
    onset: float | None
    recovered_at: float | None

    @property
    def has_precursor(self) -> bool:
        """Whether the failure has a precursor (an onset)."""
        return self.onset is not None


@dataclass(frozen=True, slots=True)
class Warning:
    """One warning: node, the names of its entity (first the JSON's own), time, hint.

    ``hint`` is the failure kind the warning's driver points at (``dbe``...), or ``""``.
    """

    node: str
    names: tuple[str, ...]
    at: float
    hint: str = ""


@dataclass(frozen=True, kw_only=True)
class Truth:
    """What a recording's labels say: failures, aliases, the recording's span and size."""

    labels: list[Label]
    aliases: AliasMap
    start: float
    end: float
    gpu_days: float
    gpus: int


def heldout_truth(labels_json: Mapping[str, Any]) -> Truth:
    """The truth of a ``benchmarks/heldout_fleet.py`` labels JSON."""
    aliases = AliasMap()
    for gpu in labels_json["entities"]["gpus"]:
        valid_to = gpu.get("valid_to")
        aliases.add(gpu["node"], gpu["aliases"], normalise(gpu["uuid"]), "gpu",
                    valid_from=-math.inf if gpu["valid_from"] <= labels_json["start"]
                    else gpu["valid_from"],
                    valid_to=math.inf if valid_to is None else valid_to)
    for port in labels_json["entities"]["ports"]:
        aliases.add(port["node"], [port["entity"]], normalise(port["entity"]), "port")
    labels = [Label(id=f["id"], kind=f["kind"], node=f["node"], entity=normalise(f["entity"]),
                    at=float(f["failure_at"]), onset=f["precursor_onset_at"],
                    recovered_at=f["recovered_at"]) for f in labels_json["failures"]]
    return Truth(labels=labels, aliases=aliases, start=float(labels_json["start"]),
                 end=float(labels_json["end"]), gpu_days=float(labels_json["gpu_days"]),
                 gpus=int(labels_json["gpus"]))


def inventory_aliases(path: Path, aliases: AliasMap) -> int:
    """Add the ``gpu_info`` inventory of a line-protocol file to ``aliases``; return GPUs seen.

    Only lines holding an ``info=`` field are decoded (``storage.lineprotocol.decode_line``).
    """
    seen: set[tuple[str, str]] = set()
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if " info=" not in line and ",info=" not in line:
                continue
            for record in decode_line(line):
                labels = getattr(record, "labels", None)
                if getattr(record, "metric", "") != "gpu_info" or labels is None:
                    continue
                node, entity = str(record.node), str(record.entity)
                names = [entity, labels.get("uuid", ""), labels.get("pci_bus_id", "")]
                if labels.get("index"):
                    names.append(f"gpu:{labels['index']}")
                if labels.get("serial"):
                    names += [f"serial:{labels['serial']}", labels["serial"]]
                key = aliases.resolve(node, [n for n in names if n], 0.0)
                aliases.add(node, names, key, "gpu")
                seen.add((node, key))
    return len(seen)


_HINTS = (
    ("link_down", ("symbol", "link_", "ib_", "port", "rcv_", "xmit")),
    ("dbe", ("ecc", "corrected", "uncorrect", "sbe", "dbe", "remap", "retired", "dram",
             "sram", "xid 48", "xid_48", "memory_error")),
    ("thermal", ("temp", "thermal", "throttl", "clock_event", "slowdown", "power")),
    ("otb", ("pcie", "replay", "xid 79", "xid_79", "fallen", "gpu_lost", "gap", "lost")),
)


def hint_of(text: str) -> str:
    """The failure kind a feature, metric or finding name points at, or ``""``.

    Examples:
        >>> hint_of("corrected_rate_6h"), hint_of("temperature_dev"), hint_of("load")
        ('dbe', 'thermal', '')
    """
    low = text.lower()
    for kind, words in _HINTS:
        if any(w in low for w in words):
            return kind
    return ""


def _names(item: Mapping[str, Any]) -> tuple[str, ...]:
    entity = str(item.get("entity") or "")
    extra = [str(a) for a in item.get("aliases") or () if a]
    return (entity, *extra)


def prediction_warnings(replay: Mapping[str, Any], threshold: float) -> list[Warning]:
    """The JSON's predictions at or above ``threshold`` (hint: the strongest feature)."""
    out = []
    for p in (replay.get("analytics") or {}).get("predictions") or ():
        if float(p.get("probability", 0.0)) < threshold or p.get("predicted_at") is None:
            continue
        features: Mapping[str, float] = p.get("top_features") or {}
        top = max(features, key=lambda k: abs(float(features[k])), default="")
        out.append(Warning(node=str(p["node"]), names=_names(p), at=float(p["predicted_at"]),
                           hint=hint_of(top)))
    return out


def anomaly_warnings(replay: Mapping[str, Any]) -> dict[str, list[Warning]]:
    """The JSON's listed anomalies by ``"<kind> <detector>"`` (hint: the metric)."""
    out: dict[str, list[Warning]] = defaultdict(list)
    for a in (replay.get("analytics") or {}).get("anomalies_listed") or ():
        if a.get("observed_at") is None or not a.get("entity"):
            continue
        metric = str(a.get("metric") or "")
        hint = "otb" if a.get("kind") == "telemetry_gap" else hint_of(metric)
        out[f"{a.get('kind')} {a.get('detector')}"].append(
            Warning(node=str(a["node"]), names=_names(a), at=float(a["observed_at"]),
                    hint=hint))
    return dict(out)


def _finding_hint(f: Mapping[str, Any]) -> str:
    kind, code = str(f.get("kind", "")), str(f.get("code", ""))
    if kind == "xid":
        return {"48": "dbe", "63": "dbe", "64": "dbe", "79": "otb"}.get(code, "")
    return hint_of(f"{kind} {code}")


def finding_warnings(replay: Mapping[str, Any], at_least: str) -> list[Warning]:
    """``nodes[].findings_seen`` (else ``findings``) at or above a severity, at first seen."""
    rank = SEVERITIES.index(at_least)
    out = []
    for node in replay.get("nodes") or ():
        found = node.get("findings_seen")
        if found is None:
            found = node.get("findings") or ()
        for f in found:
            sev = str(f.get("severity", "info"))
            if sev not in SEVERITIES or SEVERITIES.index(sev) < rank:
                continue
            at = f.get("first_seen_at")
            if at is None:
                continue
            out.append(Warning(node=str(f["node"]), names=_names(f), at=float(at),
                               hint=_finding_hint(f)))
    return out


def alert_warnings(replay: Mapping[str, Any]) -> list[Warning]:
    """``nodes[].alerts`` with an entity label, at ``starts_at``."""
    out = []
    for node in replay.get("nodes") or ():
        for a in node.get("alerts") or ():
            labels = a.get("labels") or {}
            if a.get("starts_at") is None or not labels.get("entity"):
                continue
            out.append(Warning(node=str(labels.get("node") or node.get("node")),
                               names=(str(labels["entity"]),), at=float(a["starts_at"]),
                               hint=hint_of(f"{labels.get('kind', '')} {labels.get('code', '')}")
                               if labels.get("kind") != "xid" else
                               _finding_hint(labels)))
    return out


# --- scoring -------------------------------------------------------------------------------


def score(warnings: Iterable[Warning], truth: Truth, *, before: float = BEFORE_SECONDS,
          after: float = AFTER_SECONDS, gap: float = EPISODE_GAP_SECONDS) -> dict[str, Any]:
    """Score warnings against the labels (the rules in the module docstring).

    Returns:
        ``overall`` (episodes, true, false, node-level, ignored warnings, precision, recall,
        recall on failures with precursors, median lead in hours, false episodes per 1,000
        GPU-days), ``per_kind`` (the same per failure kind, precision by attribution),
        ``per_type`` (true, false, precision for gpu and port), ``failures`` (per label:
        detected, lead) and ``false_episodes`` (each: node, entity, type, start, hint).
    """
    aliases = truth.aliases
    by_entity: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    node_level = 0
    for w in warnings:
        key = aliases.resolve(w.node, w.names, w.at)
        if aliases.type_of(w.node, key) == "node":
            node_level += 1
            continue
        by_entity[(w.node, key)].append((w.at, w.hint))
    failures_of: dict[tuple[str, str], list[Label]] = defaultdict(list)
    for label in truth.labels:
        failures_of[(label.node, label.entity)].append(label)
    for fs in failures_of.values():
        fs.sort(key=lambda f: f.at)
    lead: dict[str, float] = {}
    true_by_kind: Counter[str] = Counter()
    false_eps: list[dict[str, Any]] = []
    ignored = 0
    for (node, key), items in by_entity.items():
        items.sort()
        fs = failures_of.get((node, key), [])
        ignore = [(f.at + after, f.recovered_at if f.recovered_at is not None else math.inf)
                  for f in fs]
        opens = [f.at - before for f in fs]
        episodes: list[tuple[float, str]] = []  # (start, hint)
        last: float | None = None
        for at, hint in items:
            if any(t0 < at <= t1 for t0, t1 in ignore):
                ignored += 1
                last = None  # a failure ends the episode
                continue
            if (last is None or at - last >= gap or any(last < s <= at for s in opens)
                    or any(last <= t0 < at for t0, _ in ignore)):
                episodes.append((at, hint))
            last = at
        kind_of_entity = aliases.type_of(node, key)
        for start, hint in episodes:
            match = [f for f in fs if f.at - before <= start <= f.at + after]
            if match:
                f = min(match, key=lambda x: x.at)
                true_by_kind[f.kind] += 1
                lead[f.id] = max(lead.get(f.id, -math.inf), f.at - start)
            else:
                false_eps.append({"node": node, "entity": key, "type": kind_of_entity,
                                  "start": start,
                                  "hint": "link_down" if kind_of_entity == "port" else hint})
    n_false = len(false_eps)
    n_true = sum(true_by_kind.values())
    per_kind: dict[str, Any] = {}
    false_hints = Counter(e["hint"] for e in false_eps if e["type"] == "gpu")
    false_ports = sum(1 for e in false_eps if e["type"] == "port")
    kinds = [k for k in KINDS if any(lb.kind == k for lb in truth.labels)] or list(KINDS)
    kinds += sorted({lb.kind for lb in truth.labels} - set(kinds))
    for kind in kinds:
        ls = [lb for lb in truth.labels if lb.kind == kind]
        detected = [lb for lb in ls if lb.id in lead]
        with_pre = [lb for lb in ls if lb.has_precursor]
        det_pre = [lb for lb in with_pre if lb.id in lead]
        leads = [lead[lb.id] / HOUR for lb in det_pre]
        attributed = (false_ports if kind == "link_down"
                      else false_hints[kind] + false_hints[""])
        tp = true_by_kind[kind]
        per_kind[kind] = {
            "failures": len(ls), "with_precursor": len(with_pre), "detected": len(detected),
            "detected_with_precursor": len(det_pre),
            "recall": _ratio(len(detected), len(ls)),
            "recall_with_precursor": _ratio(len(det_pre), len(with_pre)),
            "median_lead_hours": statistics.median(leads) if leads else None,
            "true_episodes": tp, "false_episodes_attributed": attributed,
            "false_attributed_per_1000_gpu_days":
                1000.0 * attributed / truth.gpu_days if truth.gpu_days else None,
            "precision": _ratio(tp, tp + attributed),
        }
    with_pre_all = [lb for lb in truth.labels if lb.has_precursor]
    leads_all = [lead[lb.id] / HOUR for lb in with_pre_all if lb.id in lead]
    per_type = {}
    for typ, label_kinds in (("gpu", GPU_KINDS), ("port", ("link_down",))):
        tp = sum(true_by_kind[k] for k in label_kinds)
        fp = sum(1 for e in false_eps if e["type"] == typ)
        per_type[typ] = {"true_episodes": tp, "false_episodes": fp,
                         "precision": _ratio(tp, tp + fp)}
    overall = {
        "episodes": n_true + n_false, "true_episodes": n_true, "false_episodes": n_false,
        "node_level_warnings": node_level, "ignored_warnings": ignored,
        "precision": _ratio(n_true, n_true + n_false),
        "failures": len(truth.labels), "detected": len(lead),
        "recall": _ratio(len(lead), len(truth.labels)),
        "recall_with_precursor": _ratio(len(leads_all), len(with_pre_all)),
        "median_lead_hours": statistics.median(leads_all) if leads_all else None,
        "false_per_1000_gpu_days": 1000.0 * n_false / truth.gpu_days if truth.gpu_days else None,
    }
    return {
        "overall": overall, "per_kind": per_kind, "per_type": per_type,
        "failures": [{"id": lb.id, "kind": lb.kind, "node": lb.node, "entity": lb.entity,
                      "detected": lb.id in lead,
                      "lead_hours": lead[lb.id] / HOUR if lb.id in lead else None,
                      "has_precursor": lb.has_precursor} for lb in truth.labels],
        "false_by_hint": dict(Counter(e["hint"] or "unattributed" for e in false_eps)),
        "false_episodes": sorted(false_eps, key=lambda e: e["start"]),
    }


STEADY = frozenset(("steady_high_corrected_ecc", "always_warmer", "steady_pcie_replays",
                    "steady_symbol_errors", "warming_drift"))
"""Held-out confounders that last to the end of the recording once they start."""


def explain_false(result: dict[str, Any], labels_json: Mapping[str, Any]) -> None:
    """Name what lay behind each false episode of a held-out score (adds ``false_causes``).

    Causes, in this order of priority for the count: ``precursor_before_window`` (the
    entity's failure is more than 24 h later but its precursor had begun),
    ``after_recovery`` (within 24 h after the entity's recovery), the entity's own
    confounders (steady ones at any time, episodes from 6 h before to 1 h after the
    episode's start), the node's (``node:<kind>``: cooling, gaps, reloads, counter
    clears), else ``none`` (workload and noise only).
    """
    start_of = {(f["node"], normalise(f["entity"])): f for f in labels_json["failures"]}
    own: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for c in labels_json["confounders"]:
        own[(c["node"], normalise(str(c["entity"])))].append(c)
    causes: Counter[str] = Counter()
    for ep in result["false_episodes"]:
        at = ep["start"]
        why = []
        f = start_of.get((ep["node"], ep["entity"]))
        if f is not None:
            onset = f["precursor_onset_at"]
            if onset is not None and onset <= at < f["failure_at"] - BEFORE_SECONDS:
                why.append("precursor_before_window")
            rec = f["recovered_at"]
            if rec is not None and rec <= at < rec + 24 * HOUR:
                why.append("after_recovery")
        for c in own.get((ep["node"], ep["entity"]), ()):
            if (c["kind"] in STEADY and at >= c["start"]) or (
                    c["start"] - 6 * HOUR <= at <= c["end"] + HOUR):
                why.append(c["kind"])
        for c in own.get((ep["node"], "node"), ()):
            if c["start"] - 6 * HOUR <= at <= c["end"] + HOUR:
                why.append(f"node:{c['kind']}")
        ep["causes"] = why
        causes[why[0] if why else "none"] += 1
    result["false_causes"] = dict(causes.most_common())


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def goals_met(result: Mapping[str, Any]) -> dict[str, bool]:
    """Per kind: precision, recall, lead (kinds with precursors) and the false rate met."""
    rate = result["overall"]["false_per_1000_gpu_days"]
    rate_ok = rate is not None and rate <= GOALS["false_per_1000_gpu_days"]
    out = {}
    for kind, s in result["per_kind"].items():
        ok = ((s["precision"] or 0.0) >= GOALS["precision"]
              and (s["recall"] or 0.0) >= GOALS["recall"] and rate_ok)
        if s["with_precursor"]:
            ok = ok and (s["median_lead_hours"] or 0.0) >= GOALS["median_lead_hours"]
        out[kind] = ok
    return out


# --- report --------------------------------------------------------------------------------


def evaluate(replay: Mapping[str, Any], truth: Truth,
             labels_json: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Score every warning source the replay JSON carries; say what it lacks.

    With the held-out ``labels_json``, every false episode is explained
    (:func:`explain_false`).

    Args:
        replay: ``gpuhealth replay --json``'s document (:func:`gpuhealth.replay.to_json`).
        truth: The recording's failures and entities.
        labels_json: The held-out labels (confounders), or ``None``.

    Returns:
        ``scores`` (per source: :func:`score`'s result; sources ``predictions>=0.5``,
        ``predictions>=0.9``, ``anomaly:<kind> <detector>`` each, ``findings>=warning``,
        ``>=major``, ``>=critical``, ``alerts``), ``goals`` (per source, per kind:
        :func:`goals_met`) and ``notes`` (what the JSON lacks).
    """
    scores: dict[str, Any] = {}
    notes: list[str] = []
    analytics = replay.get("analytics")
    if analytics is None:
        notes.append("analytics is null (no line-protocol input analysed): no predictions or "
                      "anomalies to score")
    else:
        for threshold in THRESHOLDS:
            scores[f"predictions>={threshold:g}"] = score(prediction_warnings(replay, threshold),
                                                          truth)
        if not analytics.get("predictions"):
            notes.append(f"no prediction at or above 0.5 (made {analytics.get('predictions_made')}"
                         f", withheld {analytics.get('withheld')}, positives learned "
                         f"{analytics.get('positives_learned')})")
        listed = analytics.get("anomalies_listed") or []
        total = sum((analytics.get("anomalies") or {}).values())
        if len(listed) < total:
            notes.append(f"anomalies_listed holds {len(listed)} of {total} anomalies: their "
                         "scores cover the listed ones only")
        for name, ws in sorted(anomaly_warnings(replay).items()):
            scores[f"anomaly:{name}"] = score(ws, truth)
    nodes = replay.get("nodes") or []
    if nodes and not any("findings_seen" in n for n in nodes):
        notes.append("no findings_seen: findings are the final evaluation's only")
    for severity in ("warning", "major", "critical"):
        scores[f"findings>={severity}"] = score(finding_warnings(replay, severity), truth)
    scores["alerts"] = score(alert_warnings(replay), truth)
    if labels_json is not None:
        for result in scores.values():
            explain_false(result, labels_json)
    return {"scores": scores, "goals": {name: goals_met(s) for name, s in scores.items()},
            "notes": notes}


def truth_summary(truth: Truth) -> dict[str, Any]:
    """What was scored against: failures (per kind, with a precursor), GPUs, GPU-days, span."""
    return {"failures": len(truth.labels),
            "by_kind": dict(Counter(lb.kind for lb in truth.labels)),
            "with_precursor": sum(1 for lb in truth.labels if lb.has_precursor),
            "gpus": truth.gpus, "gpu_days": truth.gpu_days,
            "start": truth.start, "end": truth.end}


def replay_summary(replay: Mapping[str, Any]) -> dict[str, Any]:
    """The replay JSON's analysis in figures: samples, predictions made/withheld/listed..."""
    analytics = replay.get("analytics") or {}
    return {"samples": int(analytics.get("samples") or 0),
            "predictions_made": analytics.get("predictions_made"),
            "withheld": analytics.get("withheld"),
            "positives_learned": analytics.get("positives_learned"),
            "predictions_listed": len(analytics.get("predictions") or ()),
            "anomalies_listed": len(analytics.get("anomalies_listed") or ()),
            "anomalies_total": sum((analytics.get("anomalies") or {}).values())}


def fmt(value: float | None, digits: int = 2) -> str:
    """A figure of the score tables: ``digits`` decimals, ``-`` for none.

    Examples:
        >>> fmt(0.734), fmt(None), fmt(12.34, 1)
        ('0.73', '-', '12.3')
    """
    return "-" if value is None else f"{value:.{digits}f}"


def _goals_text(goals: Mapping[str, bool]) -> str:
    met = [kind for kind, ok in goals.items() if ok]
    return f"goals met for {', '.join(met)}" if met else "goals met for no kind"


def render_scores(result: Mapping[str, Any]) -> str:
    """:func:`evaluate`'s result as a table: each source per failure kind, then overall.

    Columns: failures, with a precursor, detected, precision (per kind: by attribution),
    recall, recall on failures with precursors, median lead (hours), true and false
    episodes (per kind: attributed), false episodes per 1,000 GPU-days; then the goals
    and the notes.
    """
    head = (f"{'source':<32} {'kind':<9} {'fail':>4} {'pre':>3} {'det':>3} {'prec':>5} "
            f"{'recall':>6} {'rec/pre':>7} {'lead_h':>6} {'true':>5} {'false':>5} "
            f"{'false/1k GPU-d':>14}")
    lines = [head, "-" * len(head)]
    for name, s in result["scores"].items():
        for kind, k in s["per_kind"].items():
            lines.append(
                f"{name:<32} {kind:<9} {k['failures']:>4} {k['with_precursor']:>3} "
                f"{k['detected']:>3} {fmt(k['precision']):>5} {fmt(k['recall']):>6} "
                f"{fmt(k['recall_with_precursor']):>7} {fmt(k['median_lead_hours'], 1):>6} "
                f"{k['true_episodes']:>5} {k['false_episodes_attributed']:>5} "
                f"{fmt(k['false_attributed_per_1000_gpu_days'], 1):>14}")
        o = s["overall"]
        with_pre = sum(k["with_precursor"] for k in s["per_kind"].values())
        lines.append(
            f"{name:<32} {'all':<9} {o['failures']:>4} {with_pre:>3} {o['detected']:>3} "
            f"{fmt(o['precision']):>5} {fmt(o['recall']):>6} {fmt(o['recall_with_precursor']):>7} "
            f"{fmt(o['median_lead_hours'], 1):>6} {o['true_episodes']:>5} "
            f"{o['false_episodes']:>5} {fmt(o['false_per_1000_gpu_days'], 1):>14}")
        extra = [f"{o['node_level_warnings']} node-level warnings apart"
                 if o["node_level_warnings"] else "",
                 _goals_text(result["goals"][name]) if "goals" in result else ""]
        if s.get("false_causes"):
            extra.append(f"false episodes by cause: {s['false_causes']}")
        if any(extra):
            lines.append(f"{'':<32} " + "; ".join(e for e in extra if e))
    lines.append("")
    lines.append(f"goals per kind: precision >= {GOALS['precision']} at recall >= "
                 f"{GOALS['recall']}, median lead >= {GOALS['median_lead_hours']:g} h (kinds "
                 f"with precursors), false <= {GOALS['false_per_1000_gpu_days']:g} per 1,000 "
                 "GPU-days")
    for note in result.get("notes") or ():
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"

