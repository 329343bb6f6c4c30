"""Plugin discovery through entry points and selection by name (style.md C.3.3)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, TypeVar

from core.errors import PluginError

T = TypeVar("T")

GROUPS = (
    "gpuhealth.collectors",
    "gpuhealth.stores",
    "gpuhealth.detectors",
    "gpuhealth.notifiers",
    "gpuhealth.schedulers",
    "gpuhealth.electors",
)
"""Every entry-point group gpuhealth loads plugins from."""


def available(group: str) -> dict[str, str]:
    """Return ``{name: "module:attr"}`` of the plugins installed in ``group``, sorted by name."""
    return {ep.name: ep.value for ep in sorted(entry_points(group=group), key=lambda e: e.name)}


def load(group: str, name: str) -> Any:
    """Return the object registered as ``name`` in ``group`` (usually a class).

    Raises:
        PluginError: No such plugin, or importing it failed.
    """
    found = entry_points(group=group, name=name)
    if not found:
        known = sorted(ep.name for ep in entry_points(group=group))
        raise PluginError(f"no plugin {name!r} in {group}; installed: {known}")
    (entry_point,) = tuple(found)[:1]
    try:
        return entry_point.load()
    except Exception as exc:
        raise PluginError(f"cannot load plugin {name!r} ({entry_point.value}): {exc}") from exc


def check_options(group: str, name: str, options: Mapping[str, Any], factory: Any = None
                  ) -> None:
    """Check ``options`` against the constructor of plugin ``name`` without building it.

    Every key must be a keyword argument of the constructor (unless it takes ``**kwargs``)
    and every required argument must be given.

    Args:
        group: Entry-point group.
        name: Entry-point name.
        options: The settings table's options (the constructor's keyword arguments).
        factory: The loaded plugin (default: loaded from ``group``).

    Raises:
        PluginError: No such plugin, or a key is unknown (named, with the valid ones listed)
            or a required argument is missing.
    """
    factory = load(group, name) if factory is None else factory
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no signature to check against (a builtin): the constructor decides
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = sorted(n for n, p in params.items()
                   if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                 inspect.Parameter.POSITIONAL_OR_KEYWORD)
                   and not n.startswith("_") and n != "clock")  # an object, not a setting
    unknown = sorted(key for key in options if key not in valid)
    if unknown:
        keys = ", ".join(repr(k) for k in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise PluginError(f"plugin {name!r} in {group}: unknown option{plural} {keys}; "
                          f"valid options: {', '.join(valid)}")
    missing = sorted(n for n in valid if params[n].default is inspect.Parameter.empty
                     and n not in options)
    if missing:
        raise PluginError(f"plugin {name!r} in {group}: missing required option(s) "
                          f"{', '.join(repr(k) for k in missing)}")


def build(group: str, name: str, options: Mapping[str, Any], *, expect: type[T]) -> T:
    """Instantiate the plugin registered as ``name`` in ``group`` with ``options``.

    Args:
        group: Entry-point group, e.g. ``"gpuhealth.collectors"``.
        name: Entry-point name, the ``type`` key of the settings table.
        options: Keyword arguments for the plugin's constructor.
        expect: The Protocol the instance must satisfy.

    Raises:
        PluginError: No such plugin, bad options, or it does not satisfy ``expect``.
    """
    factory = load(group, name)
    check_options(group, name, options, factory)
    try:
        instance = factory(**options)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"plugin {name!r} in {group} rejected its options: {exc}") from exc
    if not isinstance(instance, expect):
        raise PluginError(f"plugin {name!r} in {group} does not implement {expect.__name__}")
    return instance
