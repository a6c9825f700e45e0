import pytest

from sublinear import SublinearMemoryConfig, parse_size


def test_defaults_are_megengines():
    c = SublinearMemoryConfig()
    assert (c.thresh_nr_try, c.genetic_nr_iter, c.genetic_pool_size, c.lb_memory, c.num_worker, c.memory_budget,
            c.seed) == (10, 0, 20, 0, None, None, 0)
    assert c.workers >= 1


@pytest.mark.parametrize("field,value", [
    ("thresh_nr_try", -1), ("thresh_nr_try", 2.5), ("thresh_nr_try", True), ("genetic_nr_iter", -3),
    ("genetic_pool_size", 0), ("lb_memory", -1), ("num_worker", 0), ("memory_budget", 0),
    ("memory_budget", "11 gigs"), ("lb_memory", "-1GiB"), ("seed", -1), ("cache_dir", 3),
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
                                           ("4096", 4096), ("2gb", 2 * 10**9)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "11XB", "-3GiB", "GiB", "0"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)
