"""Serve a verifiers v1 environment for `agent: verifiers`, from the venv where verifiers is installed.

    .venv-verifiers/bin/python -m turnrl.agents.verifiers_serve --taskset reverse-text --address tcp://127.0.0.1:5000

verifiers' own `serve_env` (one in-process `EnvServer`, or a worker pool with `--workers N`) on the env config
`{"taskset": {"id": TASKSET}, "agent": {"harness": {"id": HARNESS}, "runtime": {"type": RUNTIME}}}` with
`--env-config JSON` merged over it (verifiers' `[env]` block: taskset options, timeouts, another env id). The
defaults suit a machine with no sandbox service: the `null` harness (verifiers' plain chat program) in a
`subprocess` runtime, where verifiers' default is a Prime sandbox (which needs a Prime login and a tunnel). The
taskset's package must be importable here (installed, or on PYTHONPATH). Nothing in turnrl's own venv imports
this module: it runs where verifiers is (its pins clash with turnrl's venv; docs/ecosystems.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any


def env_config(taskset: str, harness: str, runtime: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The env config data: the taskset, the seat's harness and runtime, then `extra` merged over it (dicts
    deep-merged)."""
    base: dict[str, Any] = {"taskset": {"id": taskset}, "agent": {"harness": {"id": harness},
                                                                  "runtime": {"type": runtime}}}
    return _merge(base, extra)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m turnrl.agents.verifiers_serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--taskset", required=True, help="the taskset id (its package must be importable)")
    parser.add_argument("--address", default="tcp://127.0.0.1:5000", help="the ZMQ address to bind")
    parser.add_argument("--harness", default="null", help="the agent seat's harness id (verifiers': null, bash, ...)")
    parser.add_argument("--runtime", default="subprocess", help="where the harness program runs (subprocess, "
                                                                "docker, prime, modal, e2b)")
    parser.add_argument("--env-config", default="{}", help="JSON merged over the env config ([env] block)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (1: one in-process server)")
    parser.add_argument("--max-concurrent", type=int, default=None, help="episodes in flight per worker")
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.env_config)
    except json.JSONDecodeError as e:
        parser.error(f"--env-config must be a JSON object: {e}")
    if not isinstance(extra, dict):
        parser.error("--env-config must be a JSON object")
    try:
        from verifiers.v1.serve.pool import serve_env
        from verifiers.v1.utils.loaders import resolve_env_config
    except ImportError:
        sys.exit("verifiers is not installed in this venv (make verifiers-install builds .venv-verifiers)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # verifiers prepares every harness program with `uv`: this venv's own (make verifiers-install) comes first
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    config = resolve_env_config(env_config(args.taskset, args.harness, args.runtime, extra))
    kwargs: dict[str, Any] = {"max_concurrent": args.max_concurrent} if args.max_concurrent else {}
    serve_env(max_workers=args.workers, address=args.address, config=config, **kwargs)


if __name__ == "__main__":
    main()
