"""InfluxDB v2 store: writes through ``influxdb-client``'s write API, reads with Flux.

The same write API is accepted by VictoriaMetrics (``docs/infra.md`` §1), which is what CI
writes to. The schema is the one in :mod:`storage.lineprotocol`: measurement = the metric's
prefix (``gpu``, ``net``, ``ib``), field = the rest of its name, a float always
(``ecosystem-reference.md`` §0 item 16: an ``int`` would become an integer field and
conflict with later floats); tags ``node``, ``entity`` and the catalogued labels, all of
bounded cardinality (§4.3). Identity such as model, driver version or PCI bus id belongs to
the ``gpu_info`` series' labels, not to every point. Events are ``gpuhealth_event`` points.

Writes: the batch is checked (:mod:`storage.sanitize`), encoded by our own
:class:`~storage.lineprotocol.LineEncoder` (``Point`` costs 2.4-2.7x a formatted string),
cut into bodies of ``batch_size`` lines and posted with the client's **synchronous**
write API at millisecond precision. Only a refusal of the lines themselves (a 400 or 422
whose body complains about them: ``unable to parse``, ``partial write``...) is a
:class:`~core.errors.PermanentError`; every other failure, 401/403/404/405 included (a
wrong URL or token loses nothing: the spool keeps the batches until it is fixed), is a
:class:`~core.errors.TemporaryError`. 429 and 5xx are first retried by the client's
``WritesRetry`` (honours ``Retry-After``, jittered exponential backoff, at most
``max_retries`` times and ``max_retry_time_seconds``). A body that finally fails calls
``on_error`` with ``((bucket, org, precision), body, exception)`` (the shape of the
client's batching ``error_callback``) and the error is raised; on a
:class:`~core.errors.TemporaryError` the :class:`~storage.spool.SpoolingStore` keeps the
batch. The client's own
batching mode is not used: it acknowledges a write before it is sent, holds it only in
memory, and reports failures on another thread, which would lose batches that the spool
was told were written. When one body of a multi-body batch fails, the spool re-sends the
whole batch; identical points are deduplicated by the server.

Runs of batches (:meth:`InfluxDbStore.write_stream`, used by ``gpuhealth import`` and the
spool's backlog through :func:`storage.write_batches`) go faster: a helper thread checks
and encodes the next batch while this one is posted, one request in flight at a time.

Overlap: a batch of at least ``overlap_min_samples`` samples is written as two bodies; the
first half is posted from a helper thread while the second half is encoded, so the server
parses one half while we encode the other (the socket wait releases the GIL). ``write``
still returns only once both are posted, so nothing is acknowledged to the spool early.
The encoder waits until the helper has started its request and then sleeps
``overlap_delay_seconds`` so that the helper sends its whole body first: without that the
encoder held the GIL for up to the 5 ms switch interval, the body went out only after the
second half was encoded, and the overlap was slower than encode-then-post (measured so
before). Two bodies, not more: each request costs the client about 0.3 ms of Python.

Cost: ``benchmarks/store_ingest.py`` prints each stage (check and encoding, the client's HTTP
layer on a pre-built body, a bare ``http.client`` POST of the same body, the backend with
and without the overlap), with the server pinned to its own CPU where it can.

Reads: Flux through the client's query API (``from |> range |> filter |>
aggregateWindow``), parsed from annotated CSV by the client. No InfluxDB 2 server runs in
CI; the reader is tested against a local stand-in answering ``/api/v2/query``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pandas as pd
import urllib3.exceptions
from influxdb_client.client.influxdb_client import InfluxDBClient
from influxdb_client.client.write.retry import WritesRetry
from influxdb_client.client.write_api import SYNCHRONOUS
from influxdb_client.domain.write_precision import WritePrecision
from influxdb_client.rest import ApiException

from core.clock import Clock, system_clock
from core.errors import PermanentError, TemporaryError
from core.protocols import Batch
from core.records import EntityId, EntityRef, Event, NodeName, Sample
from storage.lineprotocol import LineEncoder, split_metric
from storage.sanitize import MAX_FUTURE_SECONDS, MIN_AT, check_events

logger = logging.getLogger(__name__)

_BASE_COLUMNS = ["observed_at", "node", "entity", "value"]
_FLUX_META = {"result", "table", "_start", "_stop", "_time", "_value", "_field",
              "_measurement", "node", "entity"}

_MS: Any = WritePrecision.MS  # the client annotates the class, its values are plain strings
ErrorCallback = Callable[[tuple[str, str, str], bytes, Exception], None]


_CONTENT_STATUSES = frozenset({400, 422})
"""Statuses with which a server may refuse the lines themselves (InfluxDB 2 answers 400
for lines it cannot parse or a field type conflict, 422 for points beyond the retention
policy; VictoriaMetrics 400 for lines it cannot parse)."""

_CONTENT_COMPLAINTS = ("partial write", "unable to parse", "cannot parse", "failed to parse",
                       "parse error", "field type conflict", "beyond retention",
                       "invalid field", "invalid tag", "invalid timestamp", "bad timestamp",
                       "missing field", "missing tag", "invalid number", "line protocol",
                       '"code":"invalid"')
"""What the body of a content refusal says: the server took the request and refused (some
of) the lines in it. A 400 without one of these (a proxy's HTML page, say) is not a verdict
on the data: the batch is kept and retried."""

_HINTS = {
    401: "the server refused the token (token_env); the batch is kept",
    403: "the token may not write to this bucket; the batch is kept",
    404: "nothing answers the write API at this URL: check url (and org, bucket)",
    405: "this URL does not take writes: check url",
}


def refused_for_content(status: int, body: str) -> bool:
    """Tell whether an HTTP answer refuses the lines posted, not the request.

    Args:
        status: The HTTP status.
        body: The answer's body (a JSON error or plain text).

    Examples:
        >>> refused_for_content(400, '{"code":"invalid","message":"unable to parse x"}')
        True
        >>> refused_for_content(400, "<html>Bad Request</html>")
        False
        >>> refused_for_content(404, "404 page not found")
        False
    """
    if status not in _CONTENT_STATUSES:
        return False
    text = body.lower().replace('": "', '":"')
    return any(complaint in text for complaint in _CONTENT_COMPLAINTS)


@contextlib.contextmanager
def _mapped_errors(url: str, *, writing: bool = True) -> Iterator[None]:
    """Translate client, HTTP and socket failures into our error tree.

    Reads (``writing=False``): 408, 429 and 5xx are temporary, other 4xx permanent (a
    query the server will never answer, such as Flux on VictoriaMetrics). Writes: only a
    refusal of the content (:func:`refused_for_content`) is a
    :class:`~core.errors.PermanentError`: retrying the same lines will not help. Every other
    answer (401, 403, 404, 405, 408, 413, 429, 5xx, a 400 that does not complain about the
    lines) and every connection failure is a :class:`~core.errors.TemporaryError`, so that
    the spool keeps the batch until the server (or its configuration) is fixed.
    """
    try:
        yield
    except ApiException as exc:
        status = int(exc.status or 0)
        body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(
            exc.body or "")
        said = " ".join(body.split())[:300]
        if refused_for_content(status, body) or (
                not writing and 400 <= status < 500 and status not in (408, 429)):
            raise PermanentError(f"{url}: HTTP {status} {exc.reason}: {said}") from exc
        retry_after = None
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            retry_after = float(exc.headers.get("Retry-After", ""))
        hint = _HINTS.get(status)
        raise TemporaryError(f"{url}: HTTP {status} {exc.reason}: {said}"
                             + (f" ({hint})" if hint else ""),
                             retry_after_seconds=retry_after) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise TemporaryError(f"{url}: {exc}") from exc


def _flux_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _flux_time(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _reading_boundary(samples: Sequence[Sample], at: int) -> int:
    """Return ``at`` moved forward (at most 256) so that no reading is cut in two.

    The samples of one reading (same time, node and entity) go on one line; cutting a
    batch there would write that reading as two lines.
    """
    if at <= 0 or at >= len(samples):
        return max(0, min(at, len(samples)))
    cut = samples[at - 1]
    stop = min(len(samples), at + 256)
    while at < stop and (samples[at].observed_at == cut.observed_at
                         and samples[at].entity == cut.entity
                         and samples[at].node == cut.node):
        at += 1
    return at


class InfluxDbStore:
    """A :class:`core.protocols.Store` on the InfluxDB v2 API (or VictoriaMetrics).

    Args:
        url: Base URL, e.g. ``http://127.0.0.1:8086``.
        org: Organization name or ID.
        bucket: Bucket written and read.
        token: API token; prefer ``token_env``.
        token_env: Environment variable holding the token (secrets never sit in the
            configuration file); read when ``token`` is ``None``.
        timeout_seconds: HTTP timeout of one request.
        batch_size: Lines per POST body (5,000 is near the server's sweet spot).
        max_retries: Retries of one POST on a transient failure before giving up.
        retry_interval_seconds: First retry delay; doubles up to ``max_retry_delay_seconds``.
        max_retry_delay_seconds: Longest delay between two retries.
        max_retry_time_seconds: Longest total time retrying one POST.
        enable_gzip: Compress request bodies.
        on_error: Called as ``on_error((bucket, org, precision), body, exc)`` when a body
            finally fails.
        max_future_seconds: Samples stamped further ahead of the clock are rejected.
        min_at: Samples stamped before this epoch second are rejected.
        entities_lookback_seconds: How far back :meth:`entities` looks.
        clock: Stamps unstamped records; epoch seconds.
        overlap_min_samples: Batches of at least this many samples are posted in two
            halves, the first while the second is encoded (see the module docstring);
            0 turns this off.
        overlap_delay_seconds: How long the encoder lets the helper thread send its body
            before taking the GIL back.
        stream_depth: Bodies :meth:`write_stream` encodes ahead of the one being posted
            (memory: about this many batches' line protocol).

    Attributes:
        rejected: Reason → samples and events rejected or converted before writing.
    """

    def __init__(
        self,
        *,
        url: str,
        org: str,
        bucket: str,
        token: str | None = None,
        token_env: str = "INFLUX_TOKEN",
        timeout_seconds: float = 10.0,
        batch_size: int = 5000,
        max_retries: int = 1,
        retry_interval_seconds: float = 0.25,
        max_retry_delay_seconds: float = 5.0,
        max_retry_time_seconds: float = 15.0,
        enable_gzip: bool = False,
        on_error: ErrorCallback | None = None,
        max_future_seconds: float = MAX_FUTURE_SECONDS,
        min_at: float = MIN_AT,
        entities_lookback_seconds: float = 7 * 86400.0,
        clock: Clock = system_clock,
        overlap_min_samples: int = 2000,
        overlap_delay_seconds: float = 0.0002,
        stream_depth: int = 32,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if overlap_min_samples < 0 or overlap_delay_seconds < 0:
            raise ValueError("overlap_min_samples and overlap_delay_seconds must be >= 0")
        if stream_depth < 1:
            raise ValueError(f"stream_depth must be >= 1, got {stream_depth!r}")
        self.url = url
        self.org = org
        self.bucket = bucket
        self.token_env = token_env
        self.timeout_seconds = timeout_seconds
        self.batch_size = batch_size
        self.max_retries = max_retries
        self.retry_interval_seconds = retry_interval_seconds
        self.max_retry_delay_seconds = max_retry_delay_seconds
        self.max_retry_time_seconds = max_retry_time_seconds
        self.enable_gzip = enable_gzip
        self.on_error = on_error
        self.max_future_seconds = max_future_seconds
        self.min_at = min_at
        self.entities_lookback_seconds = entities_lookback_seconds
        self.clock = clock
        self.rejected: Counter[str] = Counter()
        self._encoder = LineEncoder(precision="ms")
        self.overlap_min_samples = overlap_min_samples
        self.overlap_delay_seconds = overlap_delay_seconds
        self.stream_depth = stream_depth
        self._helper: ThreadPoolExecutor | None = None
        secret = token if token is not None else os.environ.get(token_env, "")
        retries = WritesRetry(total=max_retries, retry_interval=retry_interval_seconds,
                              max_retry_delay=max_retry_delay_seconds,
                              max_retry_time=max_retry_time_seconds, jitter_interval=100,
                              connect=max_retries, read=max_retries, status=max_retries)
        self._client = InfluxDBClient(url=url, token=secret, org=org,
                                      timeout=int(timeout_seconds * 1000),
                                      enable_gzip=enable_gzip, retries=retries)
        self._write_api = self._client.write_api(write_options=SYNCHRONOUS)
        self._query_api = self._client.query_api()

    # --- writing -------------------------------------------------------------------------

    def encode(self, samples: Sequence[Sample], events: Sequence[Event]) -> list[str]:
        """Check and encode a batch as line protocol (ms timestamps); counts rejects."""
        now = self.clock()
        lines = self._encoder.checked_samples(
            samples, now=now, counts=self.rejected, max_future_seconds=self.max_future_seconds,
            min_at=self.min_at)
        if events:
            lines += self._encoder.events(check_events(
                events, now=now, counts=self.rejected,
                max_future_seconds=self.max_future_seconds, min_at=self.min_at))
        return lines

    def write_lines(self, lines: Sequence[str]) -> None:
        """Post encoded lines (ms precision) in bodies of ``batch_size`` lines.

        Raises:
            TemporaryError: The server is unreachable or slow, or answered an error that is
                not about the lines (401, 403, 404, 405, 408, 413, 429, 5xx...).
            PermanentError: The server refused the lines themselves (a 400 or 422 that
                says so, see :func:`refused_for_content`).
        """
        for start in range(0, len(lines), self.batch_size):
            body = "\n".join(lines[start:start + self.batch_size]).encode()
            try:
                with _mapped_errors(self.url):
                    self._write_api.write(bucket=self.bucket, org=self.org, record=body,
                                          write_precision=_MS)
            except (TemporaryError, PermanentError) as exc:
                if self.on_error is not None:
                    self.on_error((self.bucket, self.org, "ms"), body, exc)
                raise

    def write(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Write a batch (see the module docstring for batching, retries and overlap).

        Raises:
            TemporaryError: Transient failure, or a server or configuration error (wrong
                URL, token); the caller (the spool) keeps the batch.
            PermanentError: The server refused the lines themselves.
        """
        if self.overlap_min_samples and len(samples) >= max(2, self.overlap_min_samples):
            self._write_overlapped(samples, events)
            return
        lines = self.encode(samples, events)
        if lines:
            self.write_lines(lines)

    def _write_overlapped(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Post the first half of the batch from a helper thread while encoding the second.

        Nothing returns before both halves are posted, so the spool is never told of a
        write that has not happened; a failure of either half raises (the first half's
        from the helper thread, after ``on_error`` was called there) and the second half is
        then not posted.
        """
        half = _reading_boundary(samples, len(samples) // 2)
        first = self.encode(samples[:half], [])
        posted: Future[None] | None = None
        if first:
            if self._helper is None:
                self._helper = self._start_helper()
            sending = threading.Event()
            posted = self._helper.submit(self._post, first, sending)
            sending.wait()
            # The poster holds the GIL until its first socket call; sleeping here lets it
            # send the whole body before the encoder below takes the GIL for milliseconds
            # (the interpreter would hand it back only after its 5 ms switch interval).
            time.sleep(self.overlap_delay_seconds)
        try:
            second = self.encode(samples[half:], events)
        finally:
            if posted is not None:
                posted.result()
        if second:
            self.write_lines(second)

    def _start_helper(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="influxdb-helper")

    def write_stream(self, batches: Iterable[Batch], *,
                     on_written: Callable[[int], None] | None = None) -> int:
        """Write ``batches`` in order, checking and encoding ahead while batches are posted.

        For a run of batches (``gpuhealth import``, a spool's backlog; see
        :func:`core.protocols.write_batches`). A helper thread takes batches from
        ``batches`` (so a generator's own work, such as parsing an imported file, runs
        there too), checks and encodes them, and queues up to ``stream_depth`` bodies
        ahead; this thread posts them one after another. The socket wait releases the GIL,
        so the server parses one batch while we encode the next, and the helper keeps
        encoding while the server stalls (VictoriaMetrics pauses for tens of milliseconds
        now and then while it merges parts; encoding only one batch ahead left those
        pauses unused). One request is in flight at a time: the order is kept, and nothing
        is acknowledged before the server answered. ``benchmarks/store_ingest.py`` measures
        it beside one :meth:`write` after another.

        Args:
            batches: (samples, events) pairs; each is one :meth:`write`'s worth (cut into
                bodies of ``batch_size`` lines).
            on_written: Called with ``n`` once the first ``n`` batches are written.

        Returns:
            The number of batches written (all of them).

        Raises:
            TemporaryError: A batch failed (after the client's retries and ``on_error``):
                the batches before it were written; it and the later ones were not (those
                encoded ahead are dropped unsent). An error raised by ``batches`` itself
                comes out likewise, after the batches before it were written.
            PermanentError: The server refused a batch; likewise.
        """
        iterator = iter(batches)
        ready: queue.Queue[list[str] | BaseException | None] = queue.Queue(
            maxsize=self.stream_depth)
        stop = threading.Event()

        def produce() -> None:
            try:
                while not stop.is_set():
                    batch = next(iterator, None)
                    if batch is None:
                        break
                    ready.put(self.encode(*batch))
            except BaseException as exc:  # handed to the posting thread, raised there
                ready.put(exc)
            else:
                ready.put(None)

        if self._helper is None:
            self._helper = self._start_helper()
        producer = self._helper.submit(produce)
        written = 0
        try:
            while (lines := ready.get()) is not None:
                if isinstance(lines, BaseException):
                    raise lines
                if lines:
                    self.write_lines(lines)
                written += 1
                if on_written is not None:
                    on_written(written)
            return written
        finally:
            # nothing of this call may run after it returns or raises
            stop.set()
            while not producer.done():
                with contextlib.suppress(queue.Empty):
                    ready.get(timeout=0.05)  # unblock a producer waiting on a full queue

    def _post(self, lines: Sequence[str], sending: threading.Event) -> None:
        sending.set()
        self.write_lines(lines)

    # --- reading -------------------------------------------------------------------------

    def flux(self, metric: str, entities: Sequence[EntityRef] | None, since_at: float,
             until_at: float, step_seconds: float | None = None) -> str:
        """Return the Flux query :meth:`read` runs.

        Examples:
            >>> store = InfluxDbStore(url="http://127.0.0.1:1", org="o", bucket="b", token="t")
            >>> print(store.flux("gpu_power_watts", None, 0.0, 60.0, 10.0))
            from(bucket: "b")
              |> range(start: 1970-01-01T00:00:00.000000Z, stop: 1970-01-01T00:01:00.001000Z)
              |> filter(fn: (r) => r._measurement == "gpu" and r._field == "power_watts")
              |> aggregateWindow(every: 10000ms, fn: mean, createEmpty: false, timeSrc: "_start")
            >>> store.close()
        """
        measurement, field_key = split_metric(metric)
        lines = [
            f"from(bucket: {_flux_string(self.bucket)})",
            f"  |> range(start: {_flux_time(since_at)}, stop: {_flux_time(until_at + 0.001)})",
            f"  |> filter(fn: (r) => r._measurement == {_flux_string(measurement)} and "
            f"r._field == {_flux_string(field_key)})",
        ]
        if entities is not None:
            terms = " or ".join(
                f"(r.node == {_flux_string(e.node)} and r.entity == {_flux_string(e.entity)})"
                for e in entities)
            lines.append(f"  |> filter(fn: (r) => {terms})")
        if step_seconds is not None:
            lines.append(f"  |> aggregateWindow(every: {round(step_seconds * 1000)}ms, fn: mean,"
                         ' createEmpty: false, timeSrc: "_start")')
        return "\n".join(lines)

    def read(
        self,
        metric: str,
        entities: Sequence[EntityRef] | None,
        since_at: float,
        until_at: float,
        step_seconds: float | None = None,
    ) -> pd.DataFrame:
        """Read one metric over ``[since_at, until_at]`` with Flux.

        Returns:
            Columns ``observed_at`` (epoch seconds), ``node``, ``entity``, ``value`` and one
            per tag, sorted by node, entity, labels and time; with ``step_seconds``, bucket
            means stamped at the bucket start.

        Raises:
            TemporaryError: The server is unreachable or failed.
        """
        if step_seconds is not None and step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
        if entities is not None and not entities:
            return pd.DataFrame(columns=_BASE_COLUMNS)
        query = self.flux(metric, entities, since_at, until_at, step_seconds)
        try:
            with _mapped_errors(self.url, writing=False):
                tables = self._query_api.query(query, org=self.org)
        except PermanentError as exc:
            if "/api/v2/query" in str(exc) or ": HTTP 404 " in str(exc):
                raise PermanentError(
                    f"{exc} -- this server does not answer Flux (/api/v2/query): "
                    "VictoriaMetrics takes the InfluxDB write API but not Flux; read it "
                    'back with [storage] type = "promql" and the same url') from exc
            raise
        rows: list[dict[str, Any]] = []
        label_keys: set[str] = set()
        for table in tables:
            for record in table.records:
                values = record.values
                labels = {k: str(v) for k, v in values.items()
                          if k not in _FLUX_META and v is not None and not k.startswith("_")}
                label_keys.update(labels)
                when = record.values.get("_time")
                rows.append({"observed_at": when.timestamp() if when else float("nan"),
                             "node": str(values.get("node", "")),
                             "entity": str(values.get("entity", "")),
                             "value": float(values.get("_value")), **labels})
        columns = _BASE_COLUMNS + sorted(label_keys)
        frame = pd.DataFrame.from_records(rows, columns=columns)
        if frame.empty:
            return frame
        order = ["node", "entity", *sorted(label_keys), "observed_at"]
        return frame.sort_values(order, kind="stable").reset_index(drop=True)

    def entities(self) -> Sequence[EntityRef]:
        """List the (node, entity) pairs written in the last ``entities_lookback_seconds``."""
        query = "\n".join([
            f"from(bucket: {_flux_string(self.bucket)})",
            f"  |> range(start: -{int(self.entities_lookback_seconds)}s)",
            "  |> filter(fn: (r) => exists r.node and exists r.entity)",
            '  |> keep(columns: ["node", "entity", "_value", "_time"])',
            '  |> group(columns: ["node", "entity"])',
            "  |> last()",
        ])
        with _mapped_errors(self.url, writing=False):
            tables = self._query_api.query(query, org=self.org)
        pairs = {(str(r.values.get("node")), str(r.values.get("entity")))
                 for t in tables for r in t.records}
        return [EntityRef(node=NodeName(n), entity=EntityId(e)) for n, e in sorted(pairs)]

    def close(self) -> None:
        """Close the client (idempotent)."""
        if self._helper is not None:
            self._helper.shutdown()
        self._write_api.close()  # type: ignore[no-untyped-call]
        self._client.close()  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return f"InfluxDbStore(url={self.url!r}, org={self.org!r}, bucket={self.bucket!r})"
