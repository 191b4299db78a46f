"""MLflow tracing of finished trajectories: one trace per trajectory, built after the fact.

The rollout already records every turn as it happens (`traj.turns`: generate and env timings,
token counts, tool calls). The tracer turns that record into spans carrying the recorded start/end times,
so tracing adds nothing to the hot path and MLflow shows the same tree as the trajectory JSONL:

    trajectory              AGENT  id, group_id, sample_index, agent, status, termination_reason, num_turns, reward, error
    └── turn N              CHAIN
        ├── generate        LLM    prompt_tokens, tokens, finish_reason, cached_prompt_tokens, policy_version
        └── env.step        CHAIN when it ran tool calls, else TOOL (a plain environment); reward, done, attempts
            └── tool:<name> TOOL   arguments in; ok, error, reward, latency_s out
                └── <function>  CHAIN  a `traced` function the tool called (verl's `rollout_trace_op`)

Traces carry the tags `turnrl.trajectory_id`, `turnrl.group_id`, `turnrl.step`, `turnrl.phase` and
`turnrl.status`, so `mlflow.search_traces(filter_string="tag.`turnrl.step` = '3'")` finds a step's traces.
Only the first `max_traces_per_step` trajectories of each (phase, step) are traced, as verl's
`max_samples_per_step`, so a large run does not flood the server. The same tracer can log a training
run's params and metrics; its traces then link to that run.

Tracing never fails a rollout: an unreachable server turns the tracer off with a warning, and an export
that raises is a warning and a count in `failures`. Exports are sent by MLflow's background thread; what
fails there is logged by MLflow itself.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx

from turnrl.types import EnvSpan, RolloutStatus, SegmentSource, Trajectory, TurnRecord

log = logging.getLogger(__name__)

_LOGGED_FAILURES = 3
"""Failures logged with a warning each; later ones are only counted."""

F = TypeVar("F", bound=Callable[..., Any])
_SPANS: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar("turnrl_spans", default=None)


# ---- spans of functions called during a rollout --------------------------------------------------
@contextmanager
def collect_spans() -> Iterator[list[dict[str, Any]]]:
    """Collect the calls of `traced` functions made inside the block (and in tasks it starts) as span records:
    `{name, start_ns, end_ns, inputs, outputs | error}`, JSON-safe. The tool agent collects them per tool call
    (`tool_calls[i].spans`), so they reach the trajectory JSONL and its MLflow trace."""
    spans: list[dict[str, Any]] = []
    token = _SPANS.set(spans)
    try:
        yield spans
    finally:
        _SPANS.reset(token)


def traced(fn: F) -> F:
    """Record each call of `fn` (sync or async) while spans are being collected; otherwise call it untouched."""
    signature = inspect.signature(fn)

    def begin(args: tuple, kwargs: dict) -> dict[str, Any] | None:
        spans = _SPANS.get()
        if spans is None:
            return None
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # the call itself will raise the right error
            bound = {}
        record = {"name": fn.__qualname__, "start_ns": time.time_ns(),
                  "inputs": _jsonable({k: v for k, v in bound.items() if k != "self"})}
        spans.append(record)
        return record

    def end(record: dict[str, Any] | None, result: Any = None, error: BaseException | None = None) -> None:
        if record is not None:
            record["end_ns"] = time.time_ns()
            if error is None:
                record["outputs"] = _jsonable(result)
            else:
                record["error"] = f"{type(error).__name__}: {error}"

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            record = begin(args, kwargs)
            try:
                result = await fn(*args, **kwargs)
            except BaseException as e:
                end(record, error=e)
                raise
            end(record, result)
            return result
        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        record = begin(args, kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            end(record, error=e)
            raise
        end(record, result)
        return result
    return wrapper  # type: ignore[return-value]


def _jsonable(value: Any) -> Any:
    """A JSON-safe copy: pydantic models by their fields, anything else JSON cannot hold by a short repr."""
    def fallback(obj: Any) -> Any:
        dump = getattr(obj, "model_dump", None)
        return dump() if callable(dump) else repr(obj)[:200]

    return json.loads(json.dumps(value, default=fallback))


class TrajectoryTracer:
    """Exports trajectories as MLflow traces (see the module docstring). `tracking_uri=None` makes a tracer
    that does nothing, so callers never branch on whether tracing is on."""

    def __init__(self, tracking_uri: str | None, experiment: str = "turnrl", max_traces_per_step: int = 16,
                 tokenizer: Any = None):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.max_traces_per_step, self.tokenizer = max_traces_per_step, tokenizer
        self.exported = 0
        self.sampled_out = 0
        self.failures = 0
        self._per_step: Counter = Counter()
        self._client: Any = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.run_name: str | None = None
        """The name of the MLflow run params and metrics go to (a training run's directory name); None: MLflow's."""
        if tracking_uri is not None:
            self._connect(tracking_uri, experiment)

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> TrajectoryTracer:
        """From a `RolloutConfig` (trace_uri, trace_experiment, max_traces_per_step)."""
        return cls(cfg.trace_uri, cfg.trace_experiment, cfg.max_traces_per_step, tokenizer)

    @property
    def enabled(self) -> bool:
        return self.experiment_id is not None

    def _connect(self, uri: str, experiment: str) -> None:
        try:
            import mlflow
        except ImportError:
            raise ModuleNotFoundError("tracing to MLflow needs the mlflow package: pip install 'turnrl[trace]'") from None
        # MLflow retries a dead server for ~4 minutes per request, so a server that dies mid-run would hold the
        # process that long at exit (MLflow flushes its queue then). Traces are best-effort: retry briefly,
        # unless the user has chosen otherwise. MLflow reads these on every request.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            if uri.startswith(("http://", "https://")):  # fail in seconds, not after MLflow's minutes of retries
                httpx.get(f"{uri.rstrip('/')}/health", timeout=5.0).raise_for_status()
            self._client = mlflow.MlflowClient(uri)
            found = self._client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
            mlflow.set_tracking_uri(uri)  # MLflow's trace exporter sends to the global tracking URI
        except Exception as e:
            self._fail(f"cannot use MLflow at {uri} (experiment {experiment!r}), tracing is off: "
                       f"{type(e).__name__}: {e}")

    # ---- traces -----------------------------------------------------------------------------------
    def export(self, traj: Trajectory, step: int = 0, phase: str = "rollout") -> str | None:
        """Send `traj` as one trace and note its id in `traj.info["mlflow_trace_id"]`. Returns the trace id,
        or None when tracing is off, the step's quota is used up, or the export failed."""
        if not self.enabled:
            return None
        if self._per_step[phase, step] >= self.max_traces_per_step:
            self.sampled_out += 1
            return None
        self._per_step[phase, step] += 1
        try:
            trace_id = self._export(traj, step, phase)
        except Exception as e:
            self._fail(f"could not trace trajectory {traj.id}: {type(e).__name__}: {e}")
            return None
        self.exported += 1
        traj.info["mlflow_trace_id"] = trace_id
        return trace_id

    def _export(self, traj: Trajectory, step: int, phase: str) -> str:
        import mlflow
        from mlflow.entities import SpanStatus, SpanStatusCode, SpanType
        from mlflow.entities.span import NO_OP_SPAN_TRACE_ID

        turns = traj.turns
        start_ns, end_ns = _bounds(turns)
        tags = {"turnrl.trajectory_id": traj.id, "turnrl.group_id": traj.group_id, "turnrl.step": str(step),
                "turnrl.phase": phase, "turnrl.status": str(traj.status)}
        root = mlflow.start_span_no_context(
            "trajectory", span_type=SpanType.AGENT, inputs={"messages": _prompt_messages(traj)},
            attributes=_trajectory_attributes(traj), tags=tags, experiment_id=self.experiment_id,
            metadata={"mlflow.sourceRun": self.run_id} if self.run_id else None, start_time_ns=start_ns,
        )
        if root.trace_id == NO_OP_SPAN_TRACE_ID:  # MLflow swallowed an error and logged it
            raise RuntimeError("MLflow returned a no-op span")
        try:
            for record in turns:
                self._turn(root, traj, record)
        except Exception as e:  # still close the trace, marked, so it does not linger in MLflow's memory
            root.end(status=SpanStatus(SpanStatusCode.ERROR, f"turnrl tracer: {e}"), end_time_ns=end_ns)
            raise
        failed = traj.status == RolloutStatus.FAILED
        root.end(outputs={"reward": traj.reward, "response": _last_assistant_text(traj)},
                 status=SpanStatus(SpanStatusCode.ERROR, traj.error or "") if failed else None, end_time_ns=end_ns)
        return root.trace_id

    def _turn(self, root: Any, traj: Trajectory, record: TurnRecord) -> None:
        from mlflow.entities import SpanType

        generate, env, turn = record.generate, record.env, record.turn
        start_ns = generate.start_ns if generate else root.start_time_ns
        end_ns = (env.end_ns if env else generate.end_ns if generate else 0) or start_ns
        turn_span = _span(root, f"turn {turn}", SpanType.CHAIN, start_ns, end_ns,
                          attributes={"turn": turn, "observation_tokens": record.observation_tokens})
        if generate is not None:
            attributes = {k: getattr(generate, k) for k in ("prompt_tokens", "tokens", "cached_prompt_tokens",
                                                              "policy_version")}
            attributes["finish_reason"] = None if generate.finish_reason is None else str(generate.finish_reason)
            _span(turn_span, "generate", SpanType.LLM, start_ns, generate.end_ns or start_ns,
                  outputs=self._decoded(traj, turn, {SegmentSource.MODEL}, "text"), attributes=attributes,
                  error=generate.error)
        if env is not None:
            self._env_step(turn_span, traj, turn, env)

    def _env_step(self, parent: Any, traj: Trajectory, turn: int, env: EnvSpan) -> None:
        from mlflow.entities import SpanType

        calls = env.info.get("tool_calls") or []
        outputs: dict[str, Any] = {"reward": env.reward, "done": env.done,
                   "info": {k: v for k, v in env.info.items() if k != "tool_calls"}}
        outputs.update(self._decoded(traj, turn, {SegmentSource.TOOL, SegmentSource.ENV}, "observation") or {})
        span = _span(parent, "env.step", SpanType.CHAIN if calls else SpanType.TOOL, env.start_ns, env.end_ns,
                     outputs=outputs, error=env.error,
                     attributes={"reward": env.reward, "done": env.done, "attempts": env.attempts})
        for call in calls:
            result = {k: call.get(k) for k in ("ok", "error", "reward", "latency_s")}
            tool = _span(span, f"tool:{call.get('name') or '(unparsed)'}", SpanType.TOOL,
                         call.get("start_ns", env.start_ns), call.get("end_ns", call.get("start_ns", env.start_ns)),
                         inputs=call.get("arguments"), outputs=result, error=call.get("error"),
                         attributes={"name": call.get("name"), "id": call.get("id"), **result})
            for inner in call.get("spans") or []:
                _span(tool, inner["name"], SpanType.CHAIN, inner["start_ns"], inner.get("end_ns", inner["start_ns"]),
                      inputs=inner.get("inputs"), outputs=inner.get("outputs"), error=inner.get("error"))

    def _decoded(self, traj: Trajectory, turn: int, sources: set[SegmentSource], key: str) -> dict[str, str] | None:
        if self.tokenizer is None:
            return None
        ids = [t for s in traj.segments if s.turn == turn and s.source in sources for t in s.token_ids]
        return {key: self.tokenizer.decode(ids)} if ids else None

    # ---- run params and metrics ---------------------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        """Log a (nested) config as run params, dotted keys; starts the run on first use."""
        items = [(k, str(v)[:6000]) for k, v in _flatten(params).items()]  # MLflow's param value limit
        for i in range(0, len(items), 100):  # and its limit of params per batch
            self._log_batch(params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Log the finite numbers of `metrics` at `step` (others, like eval tags, are skipped)."""
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        self._log_batch(metrics=numbers, step=step)

    def _log_batch(self, params: list[tuple[str, str]] | None = None, metrics: dict[str, float] | None = None,
                   step: int = 0) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric, Param

        try:
            if self.run_id is None:
                self.run_id = self._client.create_run(self.experiment_id, run_name=self.run_name).info.run_id
            now_ms = int(time.time() * 1000)
            self._client.log_batch(  # in MLflow's background thread: a slow server never stalls training
                self.run_id, params=[Param(k, v) for k, v in params or []],
                metrics=[Metric(k, v, now_ms, step) for k, v in (metrics or {}).items()], synchronous=False,
            )
        except Exception as e:
            self._fail(f"could not log to MLflow run {self.run_id}: {type(e).__name__}: {e}")

    def log_artifacts(self, files: list[Any]) -> None:
        """Upload files (a run's curves and trajectory samples) as artifacts of the run; starts it on first use."""
        if not self.enabled:
            return
        self._log_batch()  # the run exists from here on
        for f in files:
            self._client.log_artifact(self.run_id, str(f))

    def close(self) -> None:
        """Send what is still queued and end the run (if one was started). Safe to call on any tracer."""
        if not self.enabled:
            return
        import mlflow

        try:
            mlflow.flush_trace_async_logging()
            if self.run_id is not None:
                mlflow.flush_async_logging()
                self._client.set_terminated(self.run_id)
        except Exception as e:
            self._fail(f"could not flush to MLflow: {type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        self.failures += 1
        if self.failures <= _LOGGED_FAILURES:
            further = "; further tracing failures are only counted" if self.failures == _LOGGED_FAILURES else ""
            log.warning("%s%s", message, further)


def _span(parent: Any, name: str, span_type: str, start_ns: int, end_ns: int, *, inputs: Any = None,
          outputs: Any = None, attributes: dict[str, Any] | None = None, error: str | None = None) -> Any:
    """A child span with its recorded times, ended at once (the trace is sent when its root ends)."""
    import mlflow
    from mlflow.entities import SpanStatus, SpanStatusCode

    span = mlflow.start_span_no_context(name, span_type=span_type, parent_span=parent, inputs=inputs,
                                        attributes=attributes, start_time_ns=start_ns)
    status = SpanStatus(SpanStatusCode.ERROR, error) if error else None
    span.end(outputs=outputs, status=status, end_time_ns=max(end_ns, start_ns))
    return span


def _bounds(turns: list[TurnRecord]) -> tuple[int, int]:
    """First start and last end over the recorded turns; now for a trajectory that never generated."""
    times = [t for record in turns for span in (record.generate, record.env) if span is not None
             for t in (span.start_ns, span.end_ns) if t]
    if not times:
        now = time.time_ns()
        return now, now
    return min(times), max(times)


def _trajectory_attributes(traj: Trajectory) -> dict[str, Any]:
    return {"id": traj.id, "group_id": traj.group_id, "sample_index": traj.sample_index, "agent": traj.agent,
            "status": str(traj.status), "termination_reason": None if traj.termination_reason is None
            else str(traj.termination_reason), "num_turns": traj.num_turns, "reward": traj.reward,
            "error": traj.error}


def _prompt_messages(traj: Trajectory) -> list[dict[str, Any]]:
    """The messages before the first assistant reply (the trace's request)."""
    prompt = []
    for message in traj.messages:
        if message.get("role") == "assistant":
            break
        prompt.append(message)
    return prompt


def _last_assistant_text(traj: Trajectory) -> Any:
    replies = [m.get("content") for m in traj.messages if m.get("role") == "assistant"]
    return replies[-1] if replies else None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
