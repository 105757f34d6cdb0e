"""Partitions share keys out among replicas: each key to exactly one, the same in every
process, and about evenly."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from fleetpilot.runtime import Partition, partition_of

KEYS = [f"task-{n:05d}" for n in range(10_000)]


def test_every_key_is_owned_by_exactly_one_partition():
    partitions = [Partition(index, 3) for index in range(3)]
    for key in KEYS[:2_000]:
        assert [p.owns(key) for p in partitions].count(True) == 1


def test_the_whole_owns_every_key():
    whole = Partition()
    assert whole.whole and all(whole.owns(key) for key in KEYS[:100])


def test_keys_are_shared_out_about_evenly():
    shares = Counter(partition_of(key, 4) for key in KEYS)
    assert sorted(shares) == [0, 1, 2, 3]
    assert all(abs(count - 2_500) < 250 for count in shares.values()), shares


def test_every_process_agrees_on_a_key_s_owner():
    # Python's own hash() of a string is salted per process: replicas using it would each
    # own keys of their choosing, some none's and some two's.
    code = ("import sys; from fleetpilot.runtime import partition_of; "
            "print(*(partition_of(k, 7) for k in sys.argv[1:]))")
    keys = KEYS[:50]
    printed = {subprocess.run([sys.executable, "-c", code, *keys], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2)}
    assert printed == {" ".join(str(partition_of(k, 7)) for k in keys) + "\n"}


@pytest.mark.parametrize(("index", "count"), [(2, 2), (-1, 2), (0, 0)])
def test_a_partition_outside_its_count_is_refused(index, count):
    with pytest.raises(ValueError, match="partition"):
        Partition(index, count)


def test_each_count_names_its_partitions_anew():
    # Another count shares the keys out anew: its replicas must not resume the consumers of
    # the old one's, whose tasks were others.
    assert Partition(1, 2).name == "p1of2" and Partition(1, 3).name == "p1of3"
