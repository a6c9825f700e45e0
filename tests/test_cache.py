import json
import logging
import subprocess
import sys

import pytest
import torch

import sublinear
from sublinear.cache import cache_dir

from conftest import Chain


def _config(folder, **changes):
    return sublinear.SublinearMemoryConfig(cache_dir=str(folder), **changes)


def _compile(config=None):
    return sublinear.compile(Chain(8, width=16), torch.randn(256, 16), config=config)


def test_miss_then_hit_skips_the_search_and_the_timing_runs(caplog, tmp_path, monkeypatch):
    config = _config(tmp_path / "c", cost_model="measure")
    first = _compile(config).sublinear_plan
    assert not first.from_cache and first.graphs[0].cost_source == "measured on cpu"
    assert len(list((tmp_path / "c").glob("*.json"))) == 1
    import sublinear.profiling.eager_costs as profiler

    monkeypatch.setattr(profiler, "measure_node_costs", lambda *a, **k: pytest.fail("timed again"))
    with caplog.at_level(logging.INFO, logger="sublinear"):
        second = _compile(config).sublinear_plan
    assert second.from_cache and "plan cache hit" in caplog.text
    assert second.graphs[0].cost_source == "measured on cpu"  # the stored measurements
    assert second.to_plan() == first.to_plan()
    assert second.predicted_peak_bytes == first.predicted_peak_bytes


@pytest.mark.slow
def test_another_config_or_shape_misses(tmp_path):
    config = _config(tmp_path)
    _compile(config)
    assert not _compile(_config(tmp_path, thresh_nr_try=3)).sublinear_plan.from_cache
    other = sublinear.compile(Chain(8, width=16), torch.randn(64, 16), config=config)
    assert not other.sublinear_plan.from_cache


@pytest.mark.parametrize("damage", ["garbage"] + [pytest.param(damage, marks=pytest.mark.slow) for damage in (
    "wrong plan", "costs of another graph", "other graph", "null", "a list", "no history")])
@pytest.mark.slow
def test_corrupt_or_stale_entries_are_ignored_with_a_warning_and_replaced(tmp_path, damage):
    config = _config(tmp_path, cost_model="estimate")
    good = _compile(config).sublinear_plan
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    if damage == "garbage":
        text = "{not json"
    elif damage == "null":
        text = "null"
    elif damage == "a list":
        text = "[1, 2]"
    else:
        if damage == "wrong plan":
            data["split_points"] = [5, 3]
        elif damage == "other graph":
            data["num_ops"] += 1
        elif damage == "no history":
            del data["history"]
        else:
            data["costs"]["forward_seconds"].append(0.0)
        text = json.dumps(data)
    entry.write_text(text)
    for _ in range(2):  # every later compile works, the first one repairs the entry
        with pytest.warns(UserWarning, match="ignoring unusable plan cache entry") if _ == 0 else _no_warning():
            replanned = _compile(config).sublinear_plan
        assert replanned.to_plan() == good.to_plan()
    assert json.loads(entry.read_text())["split_points"] == list(good.to_plan().split_points)  # repaired


def _no_warning():
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("error")
    return stack


@pytest.mark.slow
def test_second_process_skips_the_search(tmp_path):
    code = ("import torch, sublinear, sys; sys.path.insert(0, 'tests'); from conftest import Chain; "
            "print(sublinear.compile(Chain(8, width=16), torch.randn(256, 16)).sublinear_plan.from_cache)")
    env = {"SUBLINEAR_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
            .stdout.strip() for _ in range(2)]
    assert runs == ["False", "True"]


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir(None) == tmp_path / "env"
    assert cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    assert cache_dir("") is None
    monkeypatch.delenv("SUBLINEAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir(None) == tmp_path / "xdg" / "sublinear"


def test_interrupted_write_leaves_no_entry(tmp_path, monkeypatch):
    import sublinear.cache as cache_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    # the device rates and the library calls' memory are measured and kept before the writes are interrupted (a
    # worker that has not measured them yet writes them first): the plan's write is
    _compile(sublinear.SublinearMemoryConfig(cache_dir=str(tmp_path / "warm")))
    monkeypatch.setattr(cache_module.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _compile(sublinear.SublinearMemoryConfig(cache_dir=str(tmp_path / "plans")))
    assert list((tmp_path / "plans").iterdir()) == []


@pytest.mark.slow
def test_two_executors_of_one_model_keep_their_own_entries(tmp_path, recwarn):
    """The key holds the executor (and the cost model and the config), whose profiles differ: compiling one model
    with each executor, twice, on one disk, hits each entry the second time and warns of nothing."""
    runs = [_compile(_config(tmp_path, compiler=compiler)).sublinear_plan for compiler in ("eager", "inductor") * 2]
    assert [p.from_cache for p in runs] == [False, False, True, True]
    assert [p.graphs[0].executor.split(" (")[0] for p in runs] == ["sublinear's eager executor", "inductor"] * 2
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert not [w for w in recwarn if "plan cache" in str(w.message)]


def test_library_call_memory_of_sublinears_own_operators_is_not_kept_on_disk(tmp_path, monkeypatch):
    """A call's scratch is cached per machine; sublinear's own operators allocate what this package's code does,
    which the machine's key does not name, so their entries are measured again in each process."""
    from sublinear.profiling.kernels import KernelMemory, Measured
    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", str(tmp_path))
    library = "aten.mm.default((4, 4), (4, 4))"
    own = "torch.ops.sublinear.linear_cross_entropy.default((4, 4), (8, 4))"
    KernelMemory(torch.device("cpu")).remember({library: Measured(64, ("float32",)), own: Measured(999, ())})
    later = KernelMemory(torch.device("cpu"))
    assert later.get(library) == Measured(64, ("float32",))
    assert later.get(own) is None
