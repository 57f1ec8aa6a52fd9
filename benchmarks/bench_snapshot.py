"""5. Snapshot encode and decode of a 50-message SessionState.

``sa.dump_snapshot`` / ``sa.load_snapshot`` (strict hooks, limits, schema
check, msgpack Timestamps) against plain cattrs with its msgpack preset
(``cattrs.preconf.msgpack.make_converter()``, its ``dumps`` / ``loads``) on
the same records. CPU time; every round times both, interleaved.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable

import cattrs.preconf.msgpack

import sessionactors as sa
from _common import Row, cpu, log, median, paired, spread


def make_state(messages: int = 50) -> sa.SessionState:
    """A realistic conversation: user and assistant turns, a few tool calls and results."""
    start = datetime.datetime(2025, 1, 1, 12, 0, tzinfo=datetime.UTC)
    history: list[sa.Message] = []
    i = 0
    while len(history) < messages:
        at = start + datetime.timedelta(seconds=len(history) * 7)
        history.append(
            sa.Message(
                id=f"msg_{len(history):032x}",
                role=sa.Role.USER,
                content=f"Question {i}: where is my order A{1000 + i}? " * 3,
                created_at=at,
            )
        )
        if i % 5 == 4 and len(history) + 3 <= messages:
            call = sa.ToolCall(
                id=f"call_{i:028x}", name="lookup_order", arguments=f'{{"order_id": "A{1000 + i}"}}'
            )
            history.append(
                sa.Message(
                    id=f"msg_{len(history):032x}",
                    role=sa.Role.ASSISTANT,
                    content="",
                    created_at=at,
                    tool_calls=(call,),
                )
            )
            history.append(
                sa.Message(
                    id=f"msg_{len(history):032x}",
                    role=sa.Role.TOOL,
                    content='{"status": "shipped", "eta": "2025-01-03"}',
                    created_at=at,
                    tool_call_id=call.id,
                )
            )
        if len(history) < messages:
            history.append(
                sa.Message(
                    id=f"msg_{len(history):032x}",
                    role=sa.Role.ASSISTANT,
                    content=f"Your order A{1000 + i} has shipped and should arrive soon. " * 5,
                    created_at=at,
                )
            )
        i += 1
    return sa.SessionState(
        session_id="support-123",
        agent="support",
        status=sa.Status.IDLE,
        messages=tuple(history),
        metadata={"tenant": "acme", "plan": "pro", "tags": ["vip", "eu"]},
        event_seq=4 * messages,
        created_at=start,
        updated_at=start + datetime.timedelta(minutes=30),
        turn_count=messages // 2,
    )


def _time(fn: Callable[[], object], n: int) -> float:
    start = cpu()
    for _ in range(n):
        fn()
    return (cpu() - start) / n


def main(args: argparse.Namespace) -> list[Row]:
    state = make_state(50)
    plain = cattrs.preconf.msgpack.make_converter()
    ours_bytes = sa.dump_snapshot(state)
    plain_bytes = plain.dumps(state)
    assert sa.load_snapshot(ours_bytes) == state
    assert plain.loads(plain_bytes, sa.SessionState).messages[-1].content == (
        state.messages[-1].content
    )
    n = 300 if args.quick else 1500
    count = 3 if args.quick else 9
    results: dict[str, list[float]] = {k: [] for k in ("dump", "plain_dump", "load", "plain_load")}
    for r in range(count):
        results["dump"].append(_time(lambda: sa.dump_snapshot(state), n))
        results["plain_dump"].append(_time(lambda: plain.dumps(state), n))
        results["load"].append(_time(lambda: sa.load_snapshot(ours_bytes), n))
        results["plain_load"].append(_time(lambda: plain.loads(plain_bytes, sa.SessionState), n))
        log(
            f"  round {r + 1}/{count}: "
            + ", ".join(f"{k} {v[-1] * 1e6:.1f} us" for k, v in results.items())
        )
    group = "5 snapshot codec, 50 messages"
    size = f"{len(ours_bytes):,} bytes (plain cattrs: {len(plain_bytes):,})"
    rows = []
    for key, name in (("dump", "encode: sa.dump_snapshot"), ("load", "decode: sa.load_snapshot")):
        rows.append(
            Row(
                benchmark=group,
                name=name,
                measured=median(results[key]) * 1e6,
                unit="us",
                baseline=median(results[f"plain_{key}"]) * 1e6,
                baseline_name="cattrs.preconf.msgpack converter, same records",
                baseline_unit="us",
                target_on="ratio",
                target_op="<=",
                target_value=1.2,
                paired_ratio=paired(results[key], results[f"plain_{key}"]),
                notes=f"{size}; {spread(results[key])}",
            )
        )
    return rows


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
