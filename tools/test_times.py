"""The README's table of each test file's time, from the last full run of the suite.

    python -m pytest -n auto       # a full run writes runs/test_times.json (tests/conftest.py)
    python -m tools.test_times     # that run's times into README.md's test section

The table is of the whole suite only: a run of some files, or one that failed, is refused,
except a run whose one failure is the table's own check (a test file it has no row for yet:
the failure this command fixes).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# the test that fails while the table lacks a test file's row (tests/test_docs.py)
STALE_TABLE = "tests/test_docs.py::test_the_readme_lists_every_test_files_time"


def table(times: dict) -> str:
    files = sorted(times["files"].items(), key=lambda kv: -kv[1])
    total = sum(s for _, s in files)
    how = "one process" if times["workers"] == 1 else f"{times['workers']} workers (pytest-xdist)"
    made = ", ".join(x for x in (times.get("commit") and f"commit {times['commit']}", times.get("date")) if x)
    lines = [f"The last full run{f' ({made})' if made else ''}: {times['wall_s']:,.0f} s of wall time on "
             f"{times['cpu']}, {how} "
             f"(`python -m pytest{'' if times['workers'] == 1 else ' -n auto'}`, then `python -m tools.test_times`). Each file's time is its tests' setup, "
             f"call and teardown, its fixtures' launches included.", "",
             f"A share is of the files' summed times, {total:,.0f} s"
             + (": more than the wall time, as the workers run files side by side." if times["workers"] > 1 else "."),
             "", "| file | seconds | share |", "|---|---|---|"]
    lines += [f"| {path} | {s:,.1f} | {s / total:.0%} |" for path, s in files]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.test_times", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--times", default=str(ROOT / "runs" / "test_times.json"),
                   help="the run's times (default: runs/test_times.json)")
    args = p.parse_args(argv)
    path = Path(args.times)
    if not path.is_file():
        print(f"error: no {path}: run the whole suite first (python -m pytest)", file=sys.stderr)
        return 2
    times = json.loads(path.read_text())
    if times["exit_status"] != 0 and set(times.get("failed") or ["?"]) != {STALE_TABLE}:
        print(f"error: the run in {path} failed (exit status {times['exit_status']}): its times are not the suite's; "
              f"fix it and run it again", file=sys.stderr)
        return 2
    from tools.figures import update_readme
    update_readme({"test-times": table(times)})
    print(table(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
