"""The composition root: one place that turns :class:`~gpuhealth.config.Settings` into stages.

Every entry point (``run``, ``agent``, ``controller``, ``replay`` and ``replay --live``)
builds its notifiers, scheduler adapters, remediation guards and pipeline here, so the
same configuration gives the same guards everywhere: the circuit breaker, the disruption
budget (fraction, cluster size, critical reserve), opt-out nodes, the rate limit, the
approval rules, probation and the step timeout. :class:`Guards` is that set as one
value; :func:`guards_of` reads it back from a built pipeline (the test that compares
entry points does).

Nothing else in ``gpuhealth/`` constructs a stage: the service, the agent, the
controller and replay call these functions.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from alerting.silences import SilenceStore
from analytics.fault_model.debounce import DEFAULT_DEBOUNCE, Debouncer
from analytics.fault_model.site_rules import SiteRule, SiteRules
from analytics.fleet import join_link_ends
from analytics.online import OnlineAnalytics
from analytics.prediction_stage import PredictionStage
from analytics.prior import PRIOR_PATH
from analytics.stage import AnalyticsStage
from core import plugins
from core.clock import Clock, system_clock
from core.errors import ConfigError, PluginError
from core.protocols import GpuLevelDrainer, Notifier, SchedulerAdapter, WorkLocator
from core.records import RemediationStep, Severity
from gpuhealth.config import (
    AnalyticsSettings,
    Settings,
    alert_policies,
    alerting_path,
    debounce_policies,
    pagerduty_routing_key,
    webhook_secret,
)
from gpuhealth.pipeline import Pipeline
from remediation.attribution import WorkAttribution
from remediation.audit import AuditLog
from remediation.bundle import BundleCollector, Bundler, LocalBundler, NodeAgentBundler
from remediation.dry_run import DryRunScheduler
from remediation.priority import PreemptionPolicy
from remediation.protective import ProtectiveCordon
from remediation.validation import (
    LocalValidator,
    NodeAgentValidator,
    NodeValidator,
    ValidationRunner,
)
from storage.journal import InputJournal

logger = logging.getLogger(__name__)

BREAKER_MIN_NODES = 3
"""The circuit breaker's default never opens below this many nodes in one window."""

BREAKER_FLEET_FRACTION = 0.2
"""Default breaker: a fifth of the fleet failing within one window is a fleet event."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Guards:
    """Every remediation guard, as one value (docs/remediation.md, "Guards").

    Attributes:
        dry_run: Record steps only.
        max_disrupted_fraction: Fleet share gpuhealth may hold out of service, (0, 1].
        cluster_size: Nodes in the fleet, >= 1.
        disruption_limit: Nodes out of service at once: ``max(1, floor(fraction x size))``.
        critical_reserve_fraction: Share of the budget kept for critical findings, [0, 1).
        opt_out_nodes: Nodes never remediated automatically.
        act_on_predictions: Predicted failures take steps beyond notify.
        breaker_max_nodes: Distinct nodes taken out within ``breaker_window_seconds``
            that open the circuit breaker; from settings ``max(3, ceil(0.2 x cluster_size))``
            unless set (``None``, breaker off, only for a dry replay of recorded files).
        breaker_window_seconds: The breaker's window, seconds.
        max_actions_per_minute: Rate limit of submitted steps, fleet-wide.
        approval_min_severity: Findings at or above it wait for a human (``None``: none).
        approval_steps: Steps that always wait for a human.
        probation_seconds: How long a fixed node is watched for a recurrence.
        step_timeout_seconds: Longest a step may run before it is failed.
        step_attempts: Tries of a transiently failing step before it fails for good.
        step_retry_max_seconds: Longest wait between two tries.
        preemption: ``[remediation.preemption]``: when low-priority work may be preempted
            for a critical job's recovery (off by default).
    """

    dry_run: bool
    max_disrupted_fraction: float
    cluster_size: int
    disruption_limit: int
    critical_reserve_fraction: float
    opt_out_nodes: frozenset[str]
    act_on_predictions: bool
    breaker_max_nodes: int | None
    breaker_window_seconds: float
    max_actions_per_minute: float
    approval_min_severity: Severity | None
    approval_steps: frozenset[RemediationStep]
    probation_seconds: float
    step_timeout_seconds: float
    step_attempts: int = 8
    step_retry_max_seconds: float = 300.0
    preemption: PreemptionPolicy = field(default_factory=PreemptionPolicy)

    def engine_options(self, identity: str) -> dict[str, Any]:
        """Keyword arguments of :class:`~remediation.engine.RemediationEngine` for these guards."""
        return {
            "identity": identity,
            "breaker_max_nodes": self.breaker_max_nodes,
            "breaker_window_seconds": self.breaker_window_seconds,
            "max_actions_per_minute": self.max_actions_per_minute,
            "approval_min_severity": self.approval_min_severity,
            "approval_steps": self.approval_steps,
            "probation_seconds": self.probation_seconds,
            "step_timeout_seconds": self.step_timeout_seconds,
            "step_attempts": self.step_attempts,
            "retry_max_seconds": self.step_retry_max_seconds,
            "preemption": self.preemption,
        }


def default_breaker(cluster_size: int) -> int:
    """The breaker's default threshold: ``max(3, ceil(0.2 x cluster_size))`` nodes.

    Examples:
        >>> default_breaker(1), default_breaker(100)
        (3, 20)
    """
    return max(BREAKER_MIN_NODES, math.ceil(BREAKER_FLEET_FRACTION * cluster_size))


def guards(settings: Settings, *, cluster_size: int | None = None,
           max_disrupted_fraction: float | None = None, dry_run: bool | None = None) -> Guards:
    """Return the guards of ``[remediation]``; the keyword arguments override the file.

    Args:
        settings: Loaded settings.
        cluster_size: Fleet size given on a command line (``replay --cluster-size``).
        max_disrupted_fraction: Budget fraction given on a command line.
        dry_run: Force dry-run on or off (``replay`` without ``--live`` is dry-run).
    """
    r = settings.remediation
    size = cluster_size if cluster_size is not None else r.cluster_size
    fraction = (max_disrupted_fraction if max_disrupted_fraction is not None
                else r.max_disrupted_fraction)
    return Guards(
        dry_run=r.dry_run if dry_run is None else dry_run,
        max_disrupted_fraction=fraction,
        cluster_size=size,
        disruption_limit=max(1, math.floor(fraction * size + 1e-9)),
        critical_reserve_fraction=r.critical_reserve_fraction,
        opt_out_nodes=frozenset(r.opt_out_nodes),
        act_on_predictions=r.act_on_predictions,
        breaker_max_nodes=r.breaker_max_nodes or default_breaker(size),
        breaker_window_seconds=r.breaker_window_seconds,
        max_actions_per_minute=r.max_actions_per_minute,
        approval_min_severity=r.approval_min_severity,
        approval_steps=frozenset(r.approval_steps),
        probation_seconds=r.probation_seconds,
        step_timeout_seconds=r.step_timeout_seconds,
        step_attempts=r.step_attempts,
        step_retry_max_seconds=r.step_retry_max_seconds,
        preemption=r.preemption.policy(),
    )


def replay_guards(*, max_disrupted_fraction: float, cluster_size: int,
                  opt_out_nodes: frozenset[str] = frozenset(), dry_run: bool = True,
                  engine_options: Mapping[str, Any] | None = None) -> Guards:
    """The guards of a replay given without a configuration (``gpuhealth replay`` flags).

    :func:`guards` of the default settings with the flags over them, so a replay without
    a file has exactly ``run``'s defaults, except the circuit breaker: off unless
    ``engine_options`` sets ``breaker_max_nodes`` (a dry replay of recorded cases is no
    fleet event). ``engine_options`` may set any engine guard (``probation_seconds``...).

    Raises:
        ValueError: An unknown engine option.
    """
    options = dict(engine_options or {})
    unknown = set(options) - _ENGINE_GUARDS
    if unknown:
        raise ValueError(f"unknown engine options {sorted(unknown)}")
    if "approval_steps" in options:
        options["approval_steps"] = frozenset(options["approval_steps"])
    options.setdefault("breaker_max_nodes", None)
    base = guards(Settings(), cluster_size=cluster_size,
                  max_disrupted_fraction=max_disrupted_fraction, dry_run=dry_run)
    return replace(base, opt_out_nodes=frozenset(opt_out_nodes), **options)


_ENGINE_GUARDS = frozenset({"breaker_max_nodes", "breaker_window_seconds",
                            "max_actions_per_minute", "approval_min_severity",
                            "approval_steps", "probation_seconds", "step_timeout_seconds",
                            "step_attempts", "step_retry_max_seconds"})


def guards_of(pipeline: Pipeline) -> Guards:
    """Read the guards back from a built pipeline (its policy and engine)."""
    policy, engine = pipeline.policy, pipeline.engine
    return Guards(
        dry_run=policy.dry_run,
        max_disrupted_fraction=policy.max_disrupted_fraction,
        cluster_size=policy.cluster_size,
        disruption_limit=policy.disruption_limit,
        critical_reserve_fraction=policy.critical_reserve_fraction,
        opt_out_nodes=frozenset(policy.opt_out_nodes),
        act_on_predictions=policy.act_on_predictions,
        breaker_max_nodes=engine.breaker_max_nodes,
        breaker_window_seconds=engine.breaker_window_seconds,
        max_actions_per_minute=engine.max_actions_per_minute,
        approval_min_severity=engine.approval_min_severity,
        approval_steps=frozenset(engine.approval_steps),
        probation_seconds=engine.probation_seconds,
        step_timeout_seconds=engine.step_timeout_seconds,
        step_attempts=engine.step_attempts,
        step_retry_max_seconds=engine.retry_max_seconds,
        preemption=engine.preemption,
    )


def _gpu_level_drain(scheduler: SchedulerAdapter | None) -> bool:
    """Whether ``scheduler`` can drain one GPU's work (adapters say so; default yes)."""
    return scheduler.gpu_level_drain if isinstance(scheduler, GpuLevelDrainer) else True


def build_notifiers(settings: Settings) -> tuple[list[Notifier], list[Notifier]]:
    """Build the alert notifiers and the pagers of ``[alerting]``.

    The log notifier is always there; a notifier whose options are wrong is logged and
    left out (the service still runs and alerts through the others).

    Returns:
        ``(notifiers, pagers)``: where alerts go, where pages go.
    """
    a = settings.alerting
    notifiers: list[Notifier] = []
    pagers: list[Notifier] = []
    wanted: list[tuple[str, dict[str, Any], list[Notifier]]] = [("log", {}, notifiers)]
    if a.webhook_url:
        options: dict[str, Any] = {"url": a.webhook_url}
        secret = webhook_secret(settings)
        if secret:
            options["secret"] = secret
        wanted.append(("webhook", options, pagers if a.webhook_route == "pages" else notifiers))
    if a.alertmanager_url:
        wanted.append(("alertmanager", {
            "url": a.alertmanager_url,
            "resend_interval_seconds": a.alertmanager_resend_interval_seconds,
            "ends_after_seconds": 4 * a.alertmanager_resend_interval_seconds,
        }, notifiers))
    routing_key = pagerduty_routing_key(settings)
    if routing_key:
        wanted.append(("pagerduty", {"routing_key": routing_key, "url": a.pagerduty_url},
                       pagers))
    for kind, options, target in wanted:
        try:
            target.append(plugins.build("gpuhealth.notifiers", kind, options, expect=Notifier))
        except (PluginError, ValueError) as exc:
            logger.error("notifier %r disabled: %s", kind, exc)  # noqa: TRY400 (expected: no traceback)
    return notifiers, pagers


def scheduler_problems(settings: Settings, *, unloadable_ok: bool = False) -> list[str]:
    """Check ``[remediation] scheduler_options`` and ``node_agent`` against the adapters.

    Run by ``gpuhealth config check`` and at start-up whatever ``dry_run`` says (a dry run
    builds no adapter, so a misspelt key would otherwise surface only on going live),
    without building anything.

    Args:
        settings: Loaded settings.
        unloadable_ok: Skip an adapter that cannot be imported here (a dry run on a host
            without its libraries) instead of reporting it.

    Returns:
        One line per problem, naming the file, the table, the bad key and the valid keys.
    """
    r = settings.remediation
    tables = [("scheduler_options", r.scheduler, dict(r.scheduler_options))]
    if r.node_agent:
        tables.append(("node_agent", "node_agent", dict(r.node_agent)))
    problems: list[str] = []
    for key, name, options in tables:
        try:
            factory = plugins.load("gpuhealth.schedulers", name)
        except PluginError as exc:
            if not unloadable_ok:
                problems.append(f"{settings.source}: [remediation] scheduler: {exc}")
            continue
        try:
            plugins.check_options("gpuhealth.schedulers", name, options, factory)
        except PluginError as exc:
            problems.append(f"{settings.source}: [remediation] {key} (scheduler {name!r}): "
                            f"{exc}")
    return problems


def build_schedulers(settings: Settings, *, live: bool | None = None
                     ) -> tuple[SchedulerAdapter | None, SchedulerAdapter | None]:
    """Build the scheduler adapter and the node agent (GPU resets) of ``[remediation]``.

    Args:
        settings: Loaded settings.
        live: Build the adapters (default: when ``dry_run = false``).

    Returns:
        ``(scheduler, node_agent)``; both ``None`` in dry run.

    Raises:
        ConfigError: An adapter is unknown or its options are wrong (names the key; in dry
            run too, for an adapter that can be imported).
    """
    r = settings.remediation
    if not (not r.dry_run if live is None else live):
        problems = scheduler_problems(settings, unloadable_ok=True)
        if problems:  # a misspelt key refused now, not on the day dry_run goes false
            raise ConfigError("\n".join(problems))
        return None, None
    try:
        scheduler = plugins.build("gpuhealth.schedulers", r.scheduler,
                                  dict(r.scheduler_options), expect=SchedulerAdapter)
        node_agent = (plugins.build("gpuhealth.schedulers", "node_agent", dict(r.node_agent),
                                    expect=SchedulerAdapter) if r.node_agent else None)
    except (PluginError, ValueError, TypeError) as exc:
        raise ConfigError(f"{settings.source}: [remediation] scheduler {r.scheduler!r}: {exc}"
                          ) from exc
    return scheduler, node_agent


def build_validator(settings: Settings) -> NodeValidator | None:
    """Build the validator of ``[remediation.validation]`` (``None`` when not configured).

    Raises:
        ConfigError: An unknown ``where`` or a bad option (names the key).
    """
    options = dict(settings.remediation.validation)
    if not options:
        return None
    r = settings.remediation
    if r.scheduler == "slurm" and str(r.scheduler_options.get("reboot_nextstate", "RESUME")
                                      ).upper() == "RESUME":
        logger.warning("[remediation.validation] with Slurm's reboot_nextstate = RESUME: a "
                       "rebooted node returns to service before its validation; set "
                       "reboot_nextstate = \"DOWN\" in [remediation.scheduler_options]")
    where = options.pop("where", "local")
    try:
        if where == "local":
            return LocalValidator(runner=ValidationRunner(node=settings.node.name, **options))
        if where == "node_agent":
            return NodeAgentValidator(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{settings.source}: [remediation.validation]: {exc}") from exc
    raise ConfigError(f"{settings.source}: [remediation.validation]: where must be 'local' or "
                      f"'node_agent', got {where!r}")


def build_bundler(settings: Settings) -> Bundler | None:
    """Build the diagnostic-bundle collector of ``[remediation.bundle]`` (``None``: none).

    Raises:
        ConfigError: An unknown ``where`` or a bad option (names the key).
    """
    options = dict(settings.remediation.bundle)
    if not options:
        return None
    where = options.pop("where", "local")
    try:
        if where == "local":
            options.setdefault("directory", str(settings.node.data_dir / "bundles"))
            return LocalBundler(collector=BundleCollector(node=settings.node.name, **options))
        if where == "node_agent":
            return NodeAgentBundler(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{settings.source}: [remediation.bundle]: {exc}") from exc
    raise ConfigError(f"{settings.source}: [remediation.bundle]: where must be 'local' or "
                      f"'node_agent', got {where!r}")


def build_pipeline(
    settings: Settings,
    *,
    guard: Guards,
    identity: str,
    scheduler: SchedulerAdapter | None = None,
    node_agent: SchedulerAdapter | None = None,
    notifiers: Sequence[Notifier] = (),
    pagers: Sequence[Notifier] = (),
    is_leader: Callable[[], bool] = lambda: True,
    tick_inline: bool = False,
    facts: Mapping[str, str] | None = None,
    node_facts: Mapping[str, Mapping[str, str]] | None = None,
    audit_log_path: str | None = None,
    action_store_path: str | None = None,
    outbox_path: str | None = None,
    silences: SilenceStore | None = None,
    event_window_seconds: float | None = None,
    clock: Clock = system_clock,
    rules: Any = None,
    labels: Mapping[str, str] | None = None,
) -> Pipeline:
    """Build the analyse → alert → remediate pipeline with ``guard``.

    Args:
        settings: Loaded settings (alerting policy, labels, grouping, runbooks).
        guard: From :func:`guards`; the same value for every entry point.
        identity: This controller's identity (the engine's epoch, the audit trail).
        scheduler: From :func:`build_schedulers` (``None``: the dry-run adapter).
        node_agent: From :func:`build_schedulers`: the adapter of ``reset_gpu`` steps.
        notifiers: From :func:`build_notifiers`: where alerts go.
        pagers: From :func:`build_notifiers`: where pages go.
        is_leader: Whether this process may decide and act now.
        tick_inline: Advance the engine inside each evaluation (dry-run replay).
        facts: Machine facts for the fault model (``node``, inventory).
        node_facts: Facts per node over ``facts``.
        audit_log_path: The audit log (``None``: records only in the outputs).
        action_store_path: The action store (``None``: memory).
        outbox_path: The notification outbox (``None``: memory).
        silences: The silence store.
        event_window_seconds: Forget events not seen again for this long (``None``: never).
        clock: Now, epoch seconds.
        rules: Fault-model rules (default: all registered).
        labels: Labels on every alert besides ``cluster`` (a drill's ``drill=<id>``).

    Raises:
        ConfigError: The pipeline cannot be built from these settings (names the cause).
    """
    a = settings.alerting
    try:
        pipeline = Pipeline(
            scheduler=scheduler, node_agent=node_agent,
            gpu_level_drain=_gpu_level_drain(scheduler),
            action_store_path=action_store_path,
            engine_options={**guard.engine_options(identity),
                            "validator": build_validator(settings) if scheduler is not None
                            else None,
                            "bundler": build_bundler(settings) if scheduler is not None
                            else None},
            is_leader=is_leader, tick_inline=tick_inline,
            facts=dict(facts or {}), node_facts=node_facts, notifiers=notifiers,
            audit_log_path=audit_log_path, dry_run=guard.dry_run,
            max_disrupted_fraction=guard.max_disrupted_fraction,
            cluster_size=guard.cluster_size,
            opt_out_nodes=guard.opt_out_nodes,
            act_on_predictions=guard.act_on_predictions,
            critical_reserve_fraction=guard.critical_reserve_fraction,
            min_alert_severity=a.min_severity,
            resend_interval_seconds=a.resend_interval_seconds,
            page_notifiers=pagers,
            silences=silences,
            alert_policies=alert_policies(settings),
            extra_labels={**({"cluster": a.cluster} if a.cluster else {}),
                          **(labels or {})} or None,
            group_by=a.group_by,
            page_severity=a.page_severity,
            outbox_path=outbox_path,
            max_outbox=a.outbox_max_per_notifier,
            runbook_base_url=a.runbook_base_url,
            event_window_seconds=event_window_seconds,
            clock=clock,
            rules=rules,
        )
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{settings.source}: cannot start the analysis pipeline: {exc}"
                          ) from exc
    pipeline.site_rules = site_rules(settings)
    pipeline.boot_window_seconds = settings.analytics.boot_window_seconds
    pipeline.boot_kinds = frozenset(settings.analytics.boot_window_kinds)
    pipeline.debounce = debouncer(settings.analytics)
    return pipeline


def debouncer(analytics: AnalyticsSettings | None) -> Debouncer:
    """The ``[analytics.debounce]`` of ``run``, ``agent`` and ``replay`` (defaults if ``None``)."""
    return Debouncer(debounce_policies(analytics) if analytics is not None
                     else DEFAULT_DEBOUNCE)


def site_rules(settings: Settings) -> SiteRules:
    """The site's ``[[policy.rule]]`` tables as the pipeline applies them."""
    return SiteRules([
        SiteRule(name=r.name, kind=r.kind, code=r.code, entity=r.entity, nodes=r.nodes,
                 count=r.count, window_seconds=r.window, severity=r.severity, action=r.action,
                 sticky=r.sticky, ignore=r.ignore)
        for r in settings.policy.rule])


def replay_pipeline(
    *,
    guard: Guards,
    facts: Mapping[str, str],
    notifiers: Sequence[Notifier],
    audit_log_path: str | None,
    min_alert_severity: Severity,
    clock: Clock,
    rules: Any,
    page_notifiers: Sequence[Notifier],
    node_facts: Mapping[str, Mapping[str, str]] | None,
    silences: SilenceStore | None,
    alert_policies: Mapping[str, Any] | None,
    extra_labels: Mapping[str, str] | None,
    outbox_path: str | None,
    scheduler: SchedulerAdapter | None,
    action_store_path: str | None,
    analytics: AnalyticsSettings | None = None,
    policy: SiteRules | None = None,
) -> Pipeline:
    """The pipeline of ``gpuhealth replay``: recorded history, nothing forgotten.

    A dry replay advances the engine inside each evaluation; a live one (``guard.dry_run``
    false) leaves that to the replay's own event loop. ``analytics``: the ``[analytics]``
    of ``--config`` (its debounce; ``None``: the defaults, as ``run`` has them).
    ``policy``: the ``[[policy.rule]]`` of ``--config`` as ``run`` applies them
    (:func:`site_rules`); ``None``: none. Other arguments as :class:`Pipeline`'s.
    """
    pipeline = Pipeline(
        facts=facts, notifiers=notifiers, audit_log_path=audit_log_path,
        max_disrupted_fraction=guard.max_disrupted_fraction, cluster_size=guard.cluster_size,
        opt_out_nodes=guard.opt_out_nodes, act_on_predictions=guard.act_on_predictions,
        critical_reserve_fraction=guard.critical_reserve_fraction,
        min_alert_severity=min_alert_severity, clock=clock, rules=rules,
        page_notifiers=page_notifiers, node_facts=node_facts, silences=silences,
        alert_policies=alert_policies, extra_labels=extra_labels, outbox_path=outbox_path,
        scheduler=scheduler, dry_run=guard.dry_run, action_store_path=action_store_path,
        engine_options=guard.engine_options("gpuhealth"),
        gpu_level_drain=_gpu_level_drain(scheduler),
        tick_inline=guard.dry_run,
    )
    pipeline.debounce = debouncer(analytics)
    if policy is not None:
        pipeline.site_rules = policy
    return pipeline


def service_pipeline(settings: Settings, *, identity: str,
                     is_leader: Callable[[], bool], shared_state: str | None = None,
                     notify_as_standby: bool = True,
                     fleet_facts: Callable[[], Mapping[str, Mapping[str, str]]] | None = None,
                     journal_held: bool = True) -> Pipeline:
    """The pipeline of a long-running service (``run``, ``controller``).

    Args:
        settings: Loaded settings.
        identity: This process's identity (election, audit trail).
        is_leader: Whether this process may decide and act now.
        shared_state: A controller pair's PostgreSQL DSN: the action store, the audit
            trail, the silences and the notification outbox live there, shared by the
            replicas; ``None``: the data folder's files (``actions.db``, ``audit.jsonl``,
            ``silences.json``, the outbox file).
        notify_as_standby: Notify while not leader (``run``); ``False`` for a controller.
        fleet_facts: The agents' facts per node (a controller's registry): findings on the
            two ends of one link become one (:func:`~analytics.fleet.join_link_ends`).
        journal_held: Journal held findings as well as ingested artifacts (``run``); a
            controller's come back from the accepted agent records.

    Raises:
        ConfigError: A notifier, adapter or guard setting is wrong.
    """
    notifiers, pagers = build_notifiers(settings)
    scheduler, node_agent = build_schedulers(settings)
    pipeline = build_pipeline(
        settings, guard=guards(settings), identity=identity, scheduler=scheduler,
        node_agent=node_agent, notifiers=notifiers, pagers=pagers, is_leader=is_leader,
        facts={"node": settings.node.name, **settings.inventory},
        audit_log_path=shared_state or str(settings.audit_log_path),
        action_store_path=shared_state or str(settings.action_store_path),
        outbox_path=shared_state or str(alerting_path(settings, "outbox")),
        silences=SilenceStore(path=shared_state or alerting_path(settings, "silences")),
        event_window_seconds=settings.analytics.event_window_seconds,
    )
    pipeline.notify_as_standby = notify_as_standby
    pipeline.attribution = build_attribution(settings, scheduler)
    # A drill's steps (attrs["drill"]) are marked and never handed to hardware service.
    from remediation.drill import fleet_drill_adapter

    pipeline.engine.scheduler = fleet_drill_adapter(pipeline.engine.scheduler)
    if pipeline.engine.node_agent is not None:
        pipeline.engine.node_agent = fleet_drill_adapter(pipeline.engine.node_agent)
    try:
        pipeline.journal = InputJournal(shared_state or settings.node.data_dir / "journal.sqlite")
    except (OSError, sqlite3.Error) as exc:
        pipeline.close()
        raise ConfigError(f"{settings.source}: cannot open the input journal in "
                          f"{settings.node.data_dir}: {exc}") from exc
    pipeline.journal_held = journal_held
    if fleet_facts is not None:
        pipeline.join = lambda found: join_link_ends(found, fleet_facts())
    return pipeline


def agent_pipeline(settings: Settings) -> Pipeline:
    """The node-local pipeline of ``gpuhealth agent``: judge this node, decide nothing.

    The fault model, held anomaly and prediction findings run as in ``run``; nothing is
    notified, no step is requested here and nothing is audited: the findings go to the
    controllers, whose pipeline alerts and remediates under the fleet's one budget.
    """
    pipeline = build_pipeline(
        settings, guard=guards(settings, dry_run=True), identity=f"agent:{settings.node.name}",
        facts={"node": settings.node.name, **settings.inventory},
        is_leader=lambda: False,  # the agent never decides remediation
        event_window_seconds=settings.analytics.event_window_seconds,
    )
    pipeline.site_rules = SiteRules(())  # the controller applies [[policy.rule]], once
    return pipeline


def build_attribution(settings: Settings, scheduler: SchedulerAdapter | None
                      ) -> WorkAttribution | None:
    """Who names the work each fault hit: the configured scheduler, also in dry run.

    In dry run no adapter carries steps out, but reading ``squeue`` or the pods of a node
    changes nothing, so the ``[remediation] scheduler`` is built for reading; ``None``
    for the dry-run adapter or one that cannot name work.
    """
    if scheduler is None and settings.remediation.scheduler != "dry_run":
        try:
            scheduler, _ = build_schedulers(settings, live=True)
        except ConfigError as exc:
            logger.warning("work attribution off: %s", exc)
            return None
    return WorkAttribution(scheduler) if isinstance(scheduler, WorkLocator) else None


def build_protective(settings: Settings) -> ProtectiveCordon | None:
    """The agent's opt-in protective cordon (``[agent] protective_cordon``), or ``None``.

    Its adapter is ``[remediation] scheduler`` (the dry-run one while ``dry_run``), its
    audit log the agent's own ``audit.jsonl``.

    Raises:
        ConfigError: The scheduler adapter cannot be built (names the key).
    """
    a, r = settings.agent, settings.remediation
    if not a.protective_cordon:
        return None
    scheduler, _ = build_schedulers(settings)
    return ProtectiveCordon(
        adapter=scheduler if scheduler is not None else DryRunScheduler(),
        node=settings.node.name, after_seconds=a.protective_cordon_after_seconds,
        audit=AuditLog(path=str(settings.audit_log_path)), dry_run=r.dry_run,
        opted_out=settings.node.name in r.opt_out_nodes)


def build_analytics(settings: Settings, *, role: str = "run") -> AnalyticsStage:
    """The analytics stage of ``[analytics]`` for ``run`` or ``agent`` (:func:`analytics_stage`).

    The predictor keeps its checkpoint in the node's data folder; its batch refit follows
    ``predictor_refit`` (unset, it is off in the ``agent`` role).
    """
    return analytics_stage(settings.analytics, role=role,
                           checkpoint_path=settings.node.data_dir / "predictor.pkl")


def online_analytics(an: AnalyticsSettings, *, clock: Clock | None = None
                     ) -> OnlineAnalytics | None:
    """The online detectors of ``an`` on ``clock`` (``run``, ``agent`` and ``replay``)."""
    if not an.detectors:
        return None
    online = OnlineAnalytics(detector=an.detector, detector_by_metric=an.detector_by_metric,
                             gap_seconds=an.gap_seconds, warmup_samples=an.warmup_samples)
    if clock is not None:
        online.clock = clock
    return online


PREDICTOR_STEP_SECONDS = 10.0
"""Longest wait between two predictor steps (each emits only the entities due)."""


def analytics_stage(an: AnalyticsSettings, *, role: str, checkpoint_path: Path | None,
                    clock: Clock | None = None) -> AnalyticsStage:
    """The analytics stage of ``an`` for ``role``: detectors and predictor, one code path.

    ``run``, ``agent`` and ``replay`` all get it here; ``clock`` is the detectors' (the
    recording's time in a replay). The predictor steps every ``predictor_interval`` or
    :data:`PREDICTOR_STEP_SECONDS` of the stage's time, whichever is shorter.
    """
    return AnalyticsStage(online_analytics(an, clock=clock),
                          prediction_stage(an, role=role, checkpoint_path=checkpoint_path),
                          step_seconds=min(an.predictor_interval_seconds, PREDICTOR_STEP_SECONDS))


def prediction_stage(an: AnalyticsSettings, *, role: str,
                     checkpoint_path: Path | None) -> PredictionStage | None:
    """The failure predictor of ``an`` for ``role`` (``run``, ``agent``, ``replay``).

    One construction for every entry point: the same horizon, interval, prior, refit rule
    and vector detector; a replay passes no checkpoint (it starts from the prior).
    """
    if not an.predictor:
        return None
    refit = an.predictor_refit if an.predictor_refit is not None else role != "agent"
    return PredictionStage(checkpoint_path=checkpoint_path,
                           horizon_seconds=an.predictor_horizon_seconds,
                           interval_seconds=an.predictor_interval_seconds,
                           sustain_seconds=an.predictor_sustain_seconds,
                           min_positives=an.predictor_min_positives,
                           vector_detector=an.vector_detector, refit=refit,
                           prior=PRIOR_PATH)  # not blind before its first failure
