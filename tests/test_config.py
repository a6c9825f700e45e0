import pytest

from sublinear import SublinearMemoryConfig, parse_size


def test_defaults_are_megengines_with_the_device_budget_and_a_time_cap():
    c = SublinearMemoryConfig()
    assert (c.thresh_nr_try, c.genetic_nr_iter, c.genetic_pool_size, c.lb_memory, c.num_worker, c.seed) == \
        (10, 0, 20, 0, None, 0)
    assert (c.memory_budget, c.memory_headroom, c.max_time_ratio, c.cost_model) == ("auto", 0.1, 1.35, "auto")
    assert c.max_time_ratio <= 1.5  # no default makes a step more than 1.5x slower than eager
    assert c.workers >= 1


@pytest.mark.parametrize("field,value,message", [
    ("thresh_nr_try", 10**9, "thresh_nr_try must be <= 1000"),
    ("genetic_pool_size", 10**8, "genetic_pool_size must be <= 1000"),
    ("genetic_nr_iter", 10**6, "genetic_nr_iter must be <= 10000"),
    ("max_time_ratio", 0.9, "max_time_ratio must be a number >= 1.0"),
    ("min_memory_per_time", -0.5, "min_memory_per_time must be a number >= 0"),
    ("memory_headroom", 1.0, "memory_headroom must be a fraction"),
    ("cost_model", "flops", "cost_model must be one of"),
    ("planners", "grid", "planners must be a tuple"),
])
def test_bounds_give_a_clear_error_instead_of_hanging(field, value, message):
    with pytest.raises(ValueError, match=message):
        SublinearMemoryConfig(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("thresh_nr_try", -1), ("thresh_nr_try", 2.5), ("thresh_nr_try", True), ("genetic_nr_iter", -3),
    ("genetic_pool_size", 0), ("lb_memory", -1), ("num_worker", 0), ("memory_budget", 0),
    ("memory_budget", "11 gigs"), ("lb_memory", "-1GiB"), ("seed", -1), ("cache_dir", 3), ("chunk_lm_heads", 1),
    ("fuse_attention", "yes"), ("channels_last", "auto"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SublinearMemoryConfig(**{field: value})


def test_pool_of_one_with_the_genetic_search_on():
    SublinearMemoryConfig(genetic_pool_size=1)  # fine while the GA is off
    with pytest.raises(ValueError, match="genetic_pool_size must be >= 2"):
        SublinearMemoryConfig(genetic_nr_iter=5, genetic_pool_size=1)


def test_planning_key_ignores_where_and_how_fast():
    a = SublinearMemoryConfig(num_worker=1, cache_dir="/tmp/a")
    b = SublinearMemoryConfig(num_worker=2, cache_dir="/tmp/b")
    assert a.planning_key() == b.planning_key()
    assert a.planning_key() != SublinearMemoryConfig(seed=1).planning_key()


def test_sizes_as_text():
    c = SublinearMemoryConfig(memory_budget="11GiB", lb_memory="500MB")
    assert (c.memory_budget, c.lb_memory) == (11 * 2**30, 500 * 10**6)


@pytest.mark.parametrize("text,expected", [("11GiB", 11 * 2**30), ("500MB", 500 * 10**6), ("1.5 KiB", 1536),
                                           ("4096", 4096), ("2gb", 2 * 10**9), ("11 GB", 11 * 10**9),
                                           ("11 GiB", 11 * 2**30), ("5e7", 50_000_000), ("1.5E3", 1500),
                                           ("2e3 MB", 2 * 10**9), ("4.35 KB", 4350), (".5KiB", 512)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "11XB", "-3GiB", "GiB", "11G", "11g", "11 gigs", "-5", "-1e6", "1e", "inf"])
def test_bad_sizes_list_the_accepted_forms(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert str(info.value) == (
        f"not a size: {text!r}; accepted: a number of bytes (50000000 or 5e7), or a number with a unit: B, KB, MB, "
        'GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), as in "11GiB" or "500 MB"')


@pytest.mark.parametrize("text", ["0", "0.5", "1e-3"])
def test_sizes_below_one_byte(text):
    with pytest.raises(ValueError, match="size must be at least 1 byte"):
        parse_size(text)


def test_a_bad_budget_in_the_config_names_the_field_and_the_accepted_forms():
    with pytest.raises(ValueError, match=r"memory_budget: not a size: '11G'; accepted: .*powers of 1024.*\"auto\""):
        SublinearMemoryConfig(memory_budget="11G")


@pytest.mark.parametrize("clear, megengine, value", [
    ("grid_tries", "thresh_nr_try", 3), ("genetic_generations", "genetic_nr_iter", 7),
    ("genetic_population", "genetic_pool_size", 5), ("memory_floor", "lb_memory", 1024),
    ("scoring_processes", "num_worker", 2)])
def test_each_megengine_name_has_a_clear_alias(clear, megengine, value):
    by_clear = SublinearMemoryConfig(**{clear: value})
    assert by_clear == SublinearMemoryConfig(**{megengine: value})
    assert getattr(by_clear, megengine) == getattr(by_clear, clear) == value
    with pytest.raises(TypeError, match=f"{clear} and {megengine}"):
        SublinearMemoryConfig(**{clear: value, megengine: value})
    with pytest.raises(ValueError, match=rf"^{clear} \({megengine}\) must be"):
        SublinearMemoryConfig(**{clear: -1})
