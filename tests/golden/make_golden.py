"""Write the golden files of tests/test_codec.py: run once per format version.

    .venv/bin/python tests/golden/make_golden.py

It writes each record of ``GOLDEN_SNAPSHOTS``, ``GOLDEN_EVENTS``,
``GOLDEN_COMPACT`` and ``GOLDEN_INFOS`` to ``<name>.msgpack`` beside this
script, and never
overwrites a file: committed bytes are what old sessions look like, and they
must load forever. A new format version gets new records and new files.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from sessionactors import dump_snapshot  # noqa: E402
from sessionactors.stores import dump_events, dump_info  # noqa: E402
from test_codec import (  # noqa: E402
    GOLDEN_COMPACT,
    GOLDEN_EVENTS,
    GOLDEN_INFOS,
    GOLDEN_SNAPSHOTS,
    event_stem,
)


def main() -> None:
    blobs = {stem: dump_snapshot(state) for stem, state in GOLDEN_SNAPSHOTS.items()}
    # an event is written as a journal entry of its own (the 0.1 files hold a bare map)
    blobs |= {event_stem(tag): dump_events([event]) for tag, event in GOLDEN_EVENTS.items()}
    blobs |= {stem: dump_events(events) for stem, events in GOLDEN_COMPACT.items()}
    blobs |= {stem: dump_info(info) for stem, info in GOLDEN_INFOS.items()}
    for stem, data in sorted(blobs.items()):
        path = HERE / f"{stem}.msgpack"
        if path.exists():
            print(f"kept    {path.name} (golden files are never rewritten)")
            continue
        path.write_bytes(data)
        print(f"wrote   {path.name} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
