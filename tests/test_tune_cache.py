"""The tuner's choices on disk (runner/tune_cache.py): a second load with the same fingerprint
times nothing and takes the same choices; another fingerprint, a choice that is no longer a
candidate, a damaged file or a directory others may write to each make the tuner time again."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("triton")

from neuron.runner.linear import choose  # noqa: E402
from neuron.runner.tune_cache import TuneCache, cache_dir  # noqa: E402

GPU = {"gpu": "NVIDIA H200", "sms": 132, "kernels": "abc"}
CANDIDATES = [(2, 32, 1), (4, 64, 1), (8, 32, 1)]
SPEED = {None: 1.0, (2, 32, 1): 0.99, (4, 64, 1): 0.5, (8, 32, 1): 0.8}  # ms of each config


def tuner(cache, keys=("packed 4096x4096 int4 rows 1", "packed 4096x4096 int4 rows 8")):
    """What a load's tuner does over two shapes; returns its choices and how many timings it ran."""
    timed = []

    def ms(config):
        timed.append(config)
        return SPEED[config] if "rows 1" in key else 1.0  # at 8 rows no config beats the default

    choices = {}
    for key in keys:
        choices[key] = choose(cache, key, CANDIDATES, ms)[0]
    cache.save()
    return choices, len(timed)


def test_a_second_load_times_nothing_and_takes_the_same_choices(tmp_path):
    first, timed = tuner(TuneCache(tmp_path / "tuning", GPU))
    assert timed == 2 * (1 + len(CANDIDATES))
    assert first == {"packed 4096x4096 int4 rows 1": (4, 64, 1), "packed 4096x4096 int4 rows 8": None}
    cache = TuneCache(tmp_path / "tuning", GPU)
    assert tuner(cache) == (first, 0)
    assert (cache.hits, cache.misses) == (2, 0)
    assert (tmp_path / "tuning").stat().st_mode & 0o777 == 0o700


def test_another_gpu_or_kernel_source_times_again(tmp_path):
    tuner(TuneCache(tmp_path, GPU))
    for other in ({**GPU, "sms": 66}, {**GPU, "kernels": "abd"}):
        assert tuner(TuneCache(tmp_path, other))[1] == 2 * (1 + len(CANDIDATES))
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert tuner(TuneCache(tmp_path, GPU))[1] == 0  # the first fingerprint's file still serves


def test_a_choice_no_longer_a_candidate_is_timed_again(tmp_path, caplog):
    cache = TuneCache(tmp_path, GPU)
    tuner(cache)
    body = json.loads(cache.path.read_text())
    body["choices"]["packed 4096x4096 int4 rows 1"] = [64, 1024, 9]  # e.g. a candidate list that changed
    cache.path.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING, "neuron.runner"):
        choices, timed = tuner(TuneCache(tmp_path, GPU))
    assert timed == 1 + len(CANDIDATES) and choices["packed 4096x4096 int4 rows 1"] == (4, 64, 1)
    assert "not a candidate now" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "not json", "other fingerprint"])
def test_a_damaged_file_is_ignored_and_rewritten(tmp_path, caplog, damage):
    cache = TuneCache(tmp_path, GPU)
    tuner(cache)
    text = cache.path.read_text()
    cache.path.write_text({"truncated": text[: len(text) // 2], "not json": "\0\1garbage",
                           "other fingerprint": json.dumps({"fingerprint": {"gpu": "x"}, "choices": {}})}[damage])
    with caplog.at_level(logging.WARNING, "neuron.runner"):
        assert tuner(TuneCache(tmp_path, GPU))[1] == 2 * (1 + len(CANDIDATES))
    assert "ignored" in caplog.text
    assert tuner(TuneCache(tmp_path, GPU))[1] == 0  # rewritten whole


def test_ranks_saving_side_by_side_keep_each_other_s_choices(tmp_path):
    a, b = TuneCache(tmp_path, GPU), TuneCache(tmp_path, GPU)  # two ranks of one group, each its own shapes
    tuner(a, keys=("packed 4096x4096 int4 rows 1",))
    tuner(b, keys=("packed 12288x4096 int4 rows 1",))
    assert tuner(TuneCache(tmp_path, GPU), keys=("packed 4096x4096 int4 rows 1",
                                                  "packed 12288x4096 int4 rows 1"))[1] == 0


def test_a_directory_others_may_write_to_is_not_used(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, "neuron.runner"):
        cache = TuneCache(shared, GPU)
        tuner(cache)
    assert cache.path is None and not list(shared.iterdir())
    assert "writable by others" in caplog.text


def test_where_the_cache_lives():
    assert cache_dir({"NEURON_CACHE_DIR": "/srv/nc", "HOME": "/h"}) == Path("/srv/nc/tuning")
    assert cache_dir({"NEURON_CACHE_DIR": ""}) is None  # off
    assert str(cache_dir({"XDG_CACHE_HOME": "/x"})) == "/x/neuron/tuning"
    off = TuneCache(None, GPU)
    assert tuner(off)[1] == 2 * (1 + len(CANDIDATES)) and tuner(TuneCache(None, GPU))[1] == 2 * (1 + len(CANDIDATES))
