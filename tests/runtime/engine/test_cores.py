"""The default thread count on fake sysfs and cgroup trees: SMT siblings count once, CPUs
outside the affinity set not at all, a cgroup quota (v1 or v2, on the process's own cgroup
or one above it) caps the count, rounded down, and a missing file leaves every CPU a core."""

from __future__ import annotations

import os

import pytest

import spruce.runtime.cores as cores
from spruce.runtime.config import EngineConfig


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def topology(root, cpu: int, package: int, core: int) -> None:
    write(f"{root}/cpu{cpu}/topology/physical_package_id", f"{package}\n")
    write(f"{root}/cpu{cpu}/topology/core_id", f"{core}\n")


def test_smt_siblings_count_once_and_only_allowed_cpus_count(tmp_path):
    for cpu in range(8):  # 2 packages x 2 cores x 2 threads: siblings are cpu and cpu + 4
        topology(tmp_path, cpu, package=cpu % 4 // 2, core=cpu % 2)
    assert cores.physical_cores(list(range(8)), str(tmp_path)) == 4
    assert cores.physical_cores([0, 4], str(tmp_path)) == 1  # one core's two threads
    assert cores.physical_cores([0, 1, 2], str(tmp_path)) == 3


def test_a_cpu_without_topology_counts_as_its_own_core(tmp_path):
    topology(tmp_path, 0, 0, 0)
    assert cores.physical_cores([0, 1, 2], str(tmp_path)) == 3
    assert cores.physical_cores([0, 1], str(tmp_path / "missing")) == 2


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "150000 100000"}, 1.5),
        ({"a/b/cpu.max": "400000 100000", "a/cpu.max": "200000 100000"}, 2.0),  # the parent's
        ({"a/b/cpu.max": "100000 100000", "a/cpu.max": "max 100000"}, 1.0),
        ({}, None),
        ({"a/b/cpu.max": "garbage"}, None),
    ],
)
def test_cgroup_v2_quota_is_the_tightest_on_the_way_up(tmp_path, files, expected):
    for name, text in files.items():
        write(tmp_path / "fs" / name, text)
    write(tmp_path / "cgroup", "0::/a/b\n")
    assert cores.cgroup_cpus(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == expected


@pytest.mark.parametrize(("quota", "expected"), [("-1", None), ("250000", 2.5), ("50000", 0.5)])
def test_cgroup_v1_quota_of_the_cpu_controller(tmp_path, quota, expected):
    write(tmp_path / "fs/cpu,cpuacct/docker/x/cpu.cfs_quota_us", quota)
    write(tmp_path / "fs/cpu,cpuacct/docker/x/cpu.cfs_period_us", "100000")
    write(tmp_path / "cgroup", "4:memory:/docker/x\n1:cpu,cpuacct:/docker/x\n")
    assert cores.cgroup_cpus(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == expected


def test_default_threads_take_the_quota_rounded_down_and_at_least_one(monkeypatch):
    monkeypatch.setattr(cores, "allowed_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cores, "physical_cores", lambda cpus: len(cpus))
    for quota, expected in [(None, 4), (2.5, 2), (8.0, 4), (0.5, 1)]:
        monkeypatch.setattr(cores, "cgroup_cpus", lambda q=quota: q)
        assert cores.default_threads() == expected


def test_engine_config_defaults_to_it_and_keeps_a_given_count(monkeypatch):
    monkeypatch.setattr("spruce.runtime.config.default_threads", lambda: 3)
    assert EngineConfig.from_options().num_threads == 3
    assert EngineConfig.from_options(num_threads=5).num_threads == 5


def test_this_machine_gets_at_least_one_and_at_most_its_cpus():
    assert 1 <= cores.default_threads() <= (os.cpu_count() or 1)
