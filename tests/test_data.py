import itertools

import pytest
import torch

from common.data import Batches, TokenWindows, load_corpus
from common.errors import UserError


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus("stdlib")


def _global_batches(tokens, world, n, seq_len=32, gbs=12, seed=0):
    """The first n global batches as seen by `world` ranks: one set of rows per step."""
    iters = [iter(Batches(tokens, seq_len, gbs, dp_rank=r, dp_size=world, seed=seed)) for r in range(world)]
    out = []
    for _ in range(n):
        per_rank = [next(it) for it in iters]
        out.append(per_rank)
    return out


def _rows(per_rank):
    return sorted(tuple(row.tolist()) for x, _ in per_rank for row in x)


def test_stdlib_corpus_is_real_deterministic_python(stdlib):
    again = load_corpus("stdlib")
    assert torch.equal(stdlib.train, again.train) and torch.equal(stdlib.val, again.val)
    assert len(stdlib.train) > 5_000_000
    text = bytes(stdlib.train[:200_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert stdlib.train_files == sorted(stdlib.train_files)


def test_validation_split_never_overlaps_training(stdlib):
    assert stdlib.val_files and not set(stdlib.val_files) & set(stdlib.train_files)
    assert 0.02 < len(stdlib.val) / (len(stdlib.train) + len(stdlib.val)) < 0.10


def test_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(100, dtype=torch.uint8)
    ds = TokenWindows(tokens, 10)
    x, y = ds[3]
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))
    assert len(ds) == 9  # windows need seq_len + 1 bytes


def test_every_world_size_sees_the_same_global_batches(stdlib):
    tokens = stdlib.train[:200_000]
    reference = [_rows(b) for b in _global_batches(tokens, 1, 4)]
    for world in (2, 3, 4):
        got = [_rows(b) for b in _global_batches(tokens, world, 4)]
        assert got == reference, f"world size {world}"


def test_sharding_is_disjoint_and_complete_within_an_epoch():
    tokens = torch.randint(0, 256, (24 * 32 + 1,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    n_samples = len(TokenWindows(tokens, 32))  # 24
    for world in (1, 2, 3, 4):
        seen = []
        for rank in range(world):
            b = Batches(tokens, 32, 12, dp_rank=rank, dp_size=world, seed=1)
            seen += list(itertools.islice(iter(b.sampler), len(b.sampler)))
        assert sorted(seen) == list(range(n_samples)), f"world size {world}"


def test_each_epoch_is_a_new_shuffle_and_the_seed_matters():
    tokens = torch.randint(0, 256, (24 * 32 + 1,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    it = iter(Batches(tokens, 32, 12, seed=1))
    epoch0 = [next(it)[0] for _ in range(2)]
    epoch1 = [next(it)[0] for _ in range(2)]
    assert not torch.equal(torch.cat(epoch0), torch.cat(epoch1))
    assert sorted(map(tuple, torch.cat(epoch0).tolist())) == sorted(map(tuple, torch.cat(epoch1).tolist()))
    other_seed = next(iter(Batches(tokens, 32, 12, seed=2)))[0]
    assert not torch.equal(other_seed, epoch0[0])


def test_path_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 500)
    (tmp_path / "sub").mkdir()
    for i in range(25):
        (tmp_path / "sub" / f"{i}.txt").write_text(f"file {i}\n" * 100)
    one = load_corpus(str(tmp_path / "a.txt"))
    assert len(one.train) + len(one.val) == 6000 and len(one.val) > 0
    folder = load_corpus(str(tmp_path))
    assert len(folder.train_files) + len(folder.val_files) == 26
    assert not set(folder.train_files) & set(folder.val_files)


def test_stdlib_is_read_once_per_process_and_a_path_every_time(stdlib, tmp_path):
    assert load_corpus("stdlib") is load_corpus("stdlib")  # runs sharing a process (tools/multirun.py)
    (tmp_path / "a.txt").write_text("x" * 1000)
    assert len(load_corpus(str(tmp_path / "a.txt")).train) + len(load_corpus(str(tmp_path / "a.txt")).val) == 1000
    (tmp_path / "a.txt").write_text("x" * 2000)  # a path's files may change between runs
    again = load_corpus(str(tmp_path / "a.txt"))
    assert len(again.train) + len(again.val) == 2000


def test_synthetic_is_seeded_random_bytes():
    a, b, c = load_corpus("synthetic", seed=0), load_corpus("synthetic", seed=0), load_corpus("synthetic", seed=1)
    assert torch.equal(a.train, b.train) and not torch.equal(a.train, c.train)
    assert a.train.float().std() > 60  # uniform over 0..255


def test_missing_and_empty_paths_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no such file or folder") as e:
        load_corpus(str(tmp_path / "nope"))
    assert "\n" not in str(e.value)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="the text is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="found no files"):
        load_corpus(str(tmp_path / "d"))


def test_batch_that_does_not_divide_among_ranks_is_an_error():
    tokens = torch.zeros(10_000, dtype=torch.uint8)
    with pytest.raises(UserError, match="does not divide among 3 data-parallel ranks"):
        Batches(tokens, 32, 8, dp_rank=0, dp_size=3)
    with pytest.raises(UserError, match="fewer than one global batch"):
        Batches(tokens[:100], 32, 8)


def test_a_cuda_run_pins_its_batches_and_a_cpu_run_does_not_even_with_cuda_initialised(monkeypatch):
    """Pinning follows the run's device, not whether this process has touched CUDA (a CPU run
    in a process where CUDA is initialised pinned, and its trace counted a second copy of
    each batch). The pinned branch runs here with pin_memory stood in by a copy: what it
    yields is the pinned copy, and the unpinned batch is not kept alive beside it."""
    import gc
    import weakref

    from common.data import pins_for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert pins_for(torch.device("cuda")) and pins_for("cuda:1")
    assert not pins_for(torch.device("cpu")) and not pins_for("meta")
    unpinned, pinned = [], []

    def pin_memory(t):
        unpinned.append(weakref.ref(t))
        pinned.append(t.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    tokens = torch.randint(0, 256, (24 * 32 + 1,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    data = Batches(tokens, 32, 12, seed=1)
    assert not data.pin_memory  # Run sets it: pins_for(the run's device)
    data.pin_memory = pins_for(torch.device("cuda"))
    it = iter(data)
    x, y = next(it)
    gc.collect()
    assert x is pinned[0] and y is pinned[1]
    assert [r() for r in unpinned] == [None, None]


def test_the_loop_s_wait_for_batches_is_measured_per_step(monkeypatch, tmp_path, capsys):
    """Batches.wait_s counts the time inside next() (the loader's work: sampling, reading the
    windows, stacking) and nothing of the loop's own time between batches; a run logs each
    step's wait (metrics.jsonl's data_wait_s), and summary.json and the end table give the
    steady steps' mean and its share of the step time. A loader made slow on purpose (5 ms a
    window) must show in every number."""
    import json
    import time

    from common.data import TokenWindows
    from tools.multirun import run_script

    slow = 0.005
    window = TokenWindows.__getitem__

    def slow_window(self, i):
        time.sleep(slow)
        return window(self, i)

    monkeypatch.setattr(TokenWindows, "__getitem__", slow_window)
    data = Batches(torch.arange(1000) % 256, seq_len=8, global_batch_size=4)
    batches = iter(data)
    for _ in range(3):
        next(batches)
        time.sleep(0.05)  # the loop's own work: not a wait
    assert 3 * 4 * slow <= data.wait_s < 3 * 4 * slow + 0.1
    out = tmp_path / "run"
    code, err = run_script("step1_single_gpu/train.py", ["--model", "debug", "--steps", "4", "--seq-len", "32",
                                                         "--global-batch-size", "4", "--eval-batches", "0", "--device",
                                                         "cpu", "--data", "synthetic", "--no-trace-memory", "--out",
                                                         str(out)], capture_stderr=True)
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(4 * slow <= r["data_wait_s"] < r["step_time_s"] for r in rows[1:]), rows
    summary = json.loads((out / "summary.json").read_text())
    steady = rows[1:]  # the throughput's steps: the first (warm-up) left out
    assert summary["data_wait_s"] == pytest.approx(sum(r["data_wait_s"] for r in steady) / len(steady))
    assert summary["data_wait_share"] == pytest.approx(summary["data_wait_s"] / summary["step_time_s"])
    assert 0 < summary["data_wait_share"] < 1
    assert f"({summary['data_wait_share']:.2%} of the step time)" in capsys.readouterr().out


def test_the_window_order_is_pytorch_s_distributed_sampler_s():
    """WindowOrder yields exactly DistributedSampler's windows (drop_last) for any length,
    world size, rank, seed and epoch, shuffled or not, and from ``start`` on the same tail."""
    from torch.utils.data import DistributedSampler

    from common.data import WindowOrder
    for n, world, seed, shuffle in ((24, 1, 0, True), (25, 3, 1, True), (10_007, 4, 5, True), (9, 2, 0, False),
                                    (9_000, 3, 2, True)):
        data = range(n)
        for rank in range(world):
            ours = WindowOrder(data, num_replicas=world, rank=rank, seed=seed, shuffle=shuffle, drop_last=True)
            theirs = DistributedSampler(data, num_replicas=world, rank=rank, seed=seed, shuffle=shuffle, drop_last=True)
            for epoch in (0, 3):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                expected = list(theirs)
                ours.start = 0
                assert list(ours) == expected and len(ours) == len(theirs), (n, world, rank, epoch)
                ours.start = len(expected) // 3
                assert list(ours) == expected[len(expected) // 3:] and len(ours) == len(expected) - ours.start
    # Batches reads a batch ahead: the same order in whole batches, across its chunks of ~4096
    tokens = torch.zeros(10_007 * 2 + 1, dtype=torch.uint8)
    for world, batch in ((1, 3), (2, 8), (4, 12)):
        data = Batches(tokens, 2, batch, dp_rank=world - 1, dp_size=world, seed=7)
        theirs = DistributedSampler(range(10_007), num_replicas=world, rank=world - 1, seed=7, drop_last=True)
        assert data.sampler.ahead == batch // world and list(data.sampler) == list(theirs), (world, batch)


def test_a_resumed_loader_reads_only_the_batches_after_its_position(monkeypatch):
    """Resuming at global batch 50 of an epoch gives batch 50 (the one an uninterrupted run
    reads next) and reads its windows only: none of the 50 batches already trained on."""
    tokens = torch.randint(0, 256, (1000 * 16 + 1,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    straight = iter(Batches(tokens, 16, 8, seed=3))
    expected = [next(straight) for _ in range(52)][50:]
    read = []
    window = TokenWindows.__getitem__
    monkeypatch.setattr(TokenWindows, "__getitem__", lambda self, i: read.append(i) or window(self, i))
    resumed = Batches(tokens, 16, 8, seed=3)
    resumed.load_state_dict({"epoch": 0, "position": 50})
    it = iter(resumed)
    for x, y in expected:
        got = next(it)
        assert torch.equal(got[0], x) and torch.equal(got[1], y)
    assert len(read) == 2 * 8 and resumed.state_dict() == {"epoch": 0, "position": 52}


def test_an_epoch_s_order_costs_no_python_list_of_the_corpus():
    """A corpus of 2 million windows: the first batch allocates under 1 MB of Python objects
    (DistributedSampler's list of every index would take about 70 MB; the order is a tensor)."""
    import tracemalloc
    tokens = torch.zeros(2_000_000 * 4 + 1, dtype=torch.uint8)
    data = Batches(tokens, 4, 8, seed=0)
    tracemalloc.start()
    try:
        next(iter(data))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
