"""Run the benchmarks and write ``benchmarks/results/latest.json`` and ``latest.md``.

Usage (``make bench`` runs the first)::

    .venv/bin/python benchmarks/run.py               # everything (~10 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --quick       # smaller sizes, fewer rounds
    .venv/bin/python benchmarks/run.py --only spawn  # one benchmark (repeatable)

Each benchmark runs in a fresh interpreter (``bench_NAME.py``), measures its
baseline side by side in the same run, and reports ratios. With ``--only``,
the other benchmarks' rows are kept from the previous ``latest.json``, each
with its own date. Exits non-zero if a benchmark failed (its error is
recorded in the results).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: name -> what it measures, in the order they run.
BENCHMARKS: dict[str, str] = {
    "roundtrip": "1 request/reply floor: ref.send vs a raw trio round trip and pykka ask",
    "spawn": "2 spawning 100,000 idle sessions: RSS and time per session",
    "fanout": "3 streaming fan-out per subscriber, and a stuck subscriber",
    "wake": "4 waking a 50-message session from each store",
    "snapshot": "5 snapshot encode/decode vs plain cattrs + msgpack",
    "throughput": "6 durable turns/s, 1,000 sessions on SQLite, vs no durability and Agents SDK",
    "history": "7 durable turn at 10,000 messages vs 10",
    "hibernated": "8 registry memory for 100,000 hibernated sessions",
    "cluster": "9 RedisStore workers: a send across workers vs a local one; turns/s, 3 vs 1",
    "agent": "10 agents that act: a tool round trip vs a text turn; compaction at 10,000",
    "sse": "11 SSE clients: cost per event vs an in-process subscriber; delay to 1,000 clients",
    "listing": "12 paging a listing: a page at 100,000 sessions vs at 1,000 (memory, SQLite)",
}

TIMEOUT = 900  # seconds per benchmark: a safety net, not a measurement


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    commit = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "trio": _version("trio"),
        "sessionactors": _version("sessionactors"),
        "cattrs": _version("cattrs"),
        "msgpack": _version("msgpack"),
        "pykka": _version("pykka"),
        "openai-agents": _version("openai-agents"),
        "sqlite": sqlite3.sqlite_version,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
        "git_commit": commit,
    }


def run_one(name: str, quick: bool) -> dict[str, Any]:
    script = HERE / f"bench_{name}.py"
    with tempfile.TemporaryDirectory(prefix="sessionactors-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(script), "--out", str(out)]
        if quick:
            cmd.append("--quick")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=TIMEOUT, check=False, stdout=subprocess.PIPE)
            error = None if proc.returncode == 0 else f"exited with status {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"did not finish within {TIMEOUT} s"
        seconds = time.perf_counter() - start
        rows: list[dict[str, Any]] = []
        if error is None:
            rows = json.loads(out.read_text())["rows"]
    return {
        "name": name,
        "description": BENCHMARKS[name],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "seconds": round(seconds, 1),
        "error": error,
        "rows": rows,
    }


# ---- the markdown table -------------------------------------------------------------------


def _num(value: float, unit: str) -> str:
    if unit == "turns/s" or abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}"


def _target(row: dict[str, Any]) -> str:
    if row["target_value"] is None:
        return "-"
    value = row["target_value"]
    if row["target_on"] == "ratio":
        return f"ratio {row['target_op']} {value:g}x"
    return f"{row['target_op']} {_num(value, row['unit'])}"


def _met(row: dict[str, Any]) -> str:
    if row["met"] is None:
        return "-"
    return "yes" if row["met"] else "**no**"


def markdown(payload: dict[str, Any], ran: set[str]) -> str:
    m = payload["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"{m['date']}; Python {m['python']}, trio {m['trio']}, {m['cpu_count']} CPUs "
        f"({m['platform']}), load average at start {m['load_average'][0]:.1f}; "
        f"git {m['git_commit']}.",
        "Ratio = measured / baseline, both measured side by side in the same run "
        "(median of the rounds' ratios where every round measured both).",
        "",
        "| benchmark | measured | baseline | ratio | target | met? |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    notes: list[str] = []
    for bench in payload["benchmarks"]:
        if bench["error"]:
            lines.append(f"| {bench['description']} | failed: {bench['error']} | | | | **no** |")
            continue
        for row in bench["rows"]:
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
            baseline = (
                f"{_num(row['baseline'], row['baseline_unit'])} ({row['baseline_name']})"
                if row["baseline"] is not None
                else "-"
            )
            quick = " (quick)" if bench["quick"] else ""
            if bench["name"] not in ran:
                quick += f" (earlier run, {bench['date']})"
            lines.append(
                f"| {row['benchmark']}: {row['name']}{quick} | {_num(row['measured'], row['unit'])}"
                f" | {baseline} | {ratio} | {_target(row)} | {_met(row)} |"
            )
            if row["notes"]:
                notes.append(f"- {row['benchmark']}: {row['name']}: {row['notes']}")
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", action="append", choices=sorted(BENCHMARKS), help="run only this benchmark"
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    args = parser.parse_args()
    names = [n for n in BENCHMARKS if not args.only or n in args.only]
    RESULTS.mkdir(exist_ok=True)
    latest = RESULTS / "latest.json"
    previous: dict[str, dict[str, Any]] = {}
    if args.only and latest.exists():
        previous = {b["name"]: b for b in json.loads(latest.read_text())["benchmarks"]}
    info = machine()
    print(
        f"sessionactors benchmarks: Python {info['python']}, trio {info['trio']}, "
        f"{info['cpu_count']} CPUs, load {info['load_average'][0]:.1f}",
        flush=True,
    )
    done: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"== {name}: {BENCHMARKS[name]}", flush=True)
        done[name] = run_one(name, args.quick)
        result = done[name]
        status = f"failed: {result['error']}" if result["error"] else "ok"
        print(f"   {status} in {result['seconds']} s", flush=True)
    merged = [done.get(n) or previous[n] for n in BENCHMARKS if n in done or n in previous]
    payload = {"machine": info, "benchmarks": merged}
    latest.write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown(payload, set(done))
    (RESULTS / "latest.md").write_text(table)
    print()
    print(table)
    return 1 if any(b["error"] for b in done.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
