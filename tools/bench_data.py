"""What the corpus's size costs a training run: its memory and its wait for data, from ten
million to a billion tokens.

    python -m tools.bench_data                       # 1e7, 1e8 and 1e9 tokens (a few GB on disk)
    python -m tools.bench_data --tokens 1e6,1e7 --model debug --steps 10

For each size: a .jsonl corpus of the standard library's source, its files written again and
again until it holds that many bytes (each file a document), prepared as bytes
(``python -m tools.prepare_data --tokenizer bytes --val-every 0``: one token a byte, uint16
shards, every document trained on); then
step1_single_gpu/train.py trains on the prepared folder in a process of its own. Before each
run the shards are dropped from the operating system's file cache (``posix_fadvise``), so
every window the run reads comes from the disk, not from memory the preparation left behind.

Printed, per size: the shards on disk, the training process's peak resident memory (its
``ru_maxrss``, which counts the pages of the shards it mapped in too) and the mean wait for
a batch (the run's ``data_wait_s``) beside the mean step. The loader memory-maps the shards,
keeps each epoch's order as a tensor (common/data.py: 8 bytes a window is all that grows with
the corpus) and asks the disk for the next batch's windows while a step computes. The rows are also written to OUT/bench_data.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

from common.errors import UserError, main_guard  # noqa: E402
from common.measure.byte_units import fmt_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _count(text: str) -> int:
    try:
        n = float(text)
    except ValueError:
        n = 0
    if n < 1e5 or n != int(n):
        raise UserError(f"--tokens {text}: give whole token counts of 100000 or more, comma-separated (1e7,1e9).")
    return int(n)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--tokens", default="1e7,1e8,1e9", help="corpus sizes in tokens, comma-separated "
                   "(default: 1e7,1e8,1e9)")
    p.add_argument("--model", default="small", help="model preset of the training runs (default: small)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens a sequence (default: 512)")
    p.add_argument("--global-batch-size", type=int, default=8, help="sequences a step (default: 8)")
    p.add_argument("--steps", type=int, default=20, help="steps a run (default: 20)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--out", default="runs/bench_data", help="folder for the corpora and runs (default: runs/bench_data)")
    a = p.parse_args(argv)
    a.sizes = [_count(t) for t in a.tokens.split(",")]
    if a.steps < 3:
        raise UserError(f"--steps {a.steps}: give 3 or more (the first step warms up and is not counted).")
    return a


def stdlib_texts() -> list[str]:
    from common.data import _stdlib_files
    texts = []
    for path in _stdlib_files()[1]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue  # (the few files that are not UTF-8 are not text this corpus needs)
    return [t for t in texts if t]


def write_source(path: Path, tokens: int, texts: list[str]) -> None:
    """A .jsonl of the standard library's files, over and over, until it holds ``tokens`` bytes."""
    if path.is_file() and path.stat().st_size >= tokens:
        return
    partial, written = path.with_suffix(".partial"), 0
    with open(partial, "w", encoding="utf-8") as f:
        while written < tokens:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(text.encode())
                if written >= tokens:
                    break
    partial.rename(path)


def evict(folder: Path) -> bool:
    """Drop the shards' pages from the file cache; False where the OS cannot (no posix_fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for shard in folder.glob("*.bin"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.fsync(fd)  # (dirty pages cannot be dropped)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def train(a, data: Path, out: Path) -> tuple[dict, int]:
    """step1's script on ``data`` in a process of its own: its summary and its peak resident bytes."""
    cmd = [sys.executable, str(ROOT / "step1_single_gpu" / "train.py"), "--data", str(data), "--model", a.model,
           "--seq-len", str(a.seq_len), "--global-batch-size", str(a.global_batch_size), "--steps", str(a.steps),
           "--eval-batches", "0", "--no-trace-memory", "--device", a.device, "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage (Popen.wait would not give it)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        last = (out / "log.txt").read_text().strip().splitlines() or ["?"]
        raise UserError(f"training on {data} failed: {last[-1]}")
    return json.loads((out / "summary.json").read_text()), usage.ru_maxrss * 1024  # (Linux: KiB)


def prepare(source: Path, folder: Path) -> None:
    from tools.prepare_data import main as prepare_data
    import contextlib
    import io
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):  # (its bar and line)
        prepare_data([str(source), "--out", str(folder), "--tokenizer", "bytes", "--val-every", "0"])  # (no eval)


@main_guard
def main(argv=None):
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    texts, rows, evicted = stdlib_texts(), [], True
    for n in a.sizes:
        source, folder = out / f"corpus_{n}.jsonl", out / f"data_{n}"
        write_source(source, n, texts)
        prepare(source, folder)
        evicted &= evict(folder)
        summary, rss = train(a, folder, out / f"run_{n}")
        meta = json.loads((folder / "meta.json").read_text())
        shards = sum(s["bytes"] for split in meta["splits"].values() for s in split["shards"])
        rows.append((n, meta["splits"]["train"]["tokens"], shards, rss, summary))
    first = rows[0][4]
    print(f"{a.model} ({first['n_params'] / 1e6:.{0 if first['n_params'] >= 1e7 else 2}f}M parameters) on "
          f"{first['device_name']}, batch "
          f"{a.global_batch_size} x {a.seq_len} tokens, {a.steps} steps a run, each in a process of its own; "
          + ("the shards dropped from the file cache before each run" if evicted else
             "the shards possibly still in the file cache (this OS has no posix_fadvise)"))
    print("| training tokens | shards on disk | peak resident memory | data wait (mean) | step (mean) | "
          "wait / step |\n|---|---|---|---|---|---|")
    for n, train_tokens, shards, rss, s in rows:
        print(f"| {train_tokens:,} | {fmt_bytes(shards)} | {fmt_bytes(rss)} | "
              f"{s['data_wait_s'] * 1e3:.2f} ms | {s['step_time_s'] * 1e3:,.0f} ms | {s['data_wait_share']:.2%} |")
    rss = [r[3] for r in rows]
    (out / "bench_data.json").write_text(json.dumps([
        {"training_tokens": t, "shard_bytes": b, "peak_rss_bytes": m, "data_wait_s": s["data_wait_s"],
         "step_time_s": s["step_time_s"], "data_wait_share": s["data_wait_share"]} for _, t, b, m, s in rows], indent=1))
    print(f"From {rows[0][1]:,} to {rows[-1][1]:,} training tokens ({rows[-1][1] / rows[0][1]:,.0f}x), the peak "
          f"resident memory changed {max(rss) / min(rss):.2f}x (largest over smallest); the largest wait was "
          f"{max(r[4]['data_wait_share'] for r in rows):.2%} of a step.")


if __name__ == "__main__":
    main()
