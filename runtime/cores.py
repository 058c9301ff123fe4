"""How many CPU threads help by default: one per physical core this process may run on,
within its cgroup's CPU quota.

`os.cpu_count()` counts every logical CPU of the machine: SMT siblings (two threads on one
core share its vector units, so a second thread there adds little to a GEMV and costs a
barrier's wait), CPUs outside the process's affinity set (`taskset`, a container's cpuset)
and CPUs beyond its cgroup's quota (`docker --cpus 2` on a 64-CPU host, where 64 threads
would be throttled in turn at every parallel region). Reads Linux's sysfs and cgroup files;
where they are missing, every CPU counts as a core and no quota applies.
"""

from __future__ import annotations

import math
import os

SYS_CPU = "/sys/devices/system/cpu"
CGROUP = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity set; every CPU where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def physical_cores(cpus: list[int], root: str = SYS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus`; a CPU whose topology cannot be read
    counts as a core of its own."""
    cores = set()
    for cpu in cpus:
        topology = f"{root}/cpu{cpu}/topology"
        package, core = _read(f"{topology}/physical_package_id"), _read(f"{topology}/core_id")
        cores.add((package, core) if package is not None and core is not None else ("cpu", cpu))
    return len(cores)


def _own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """This process's cgroup path by controller ("" for the v2 hierarchy)."""
    paths = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _ancestors(base: str, path: str):
    """base + path, then each folder above it up to base."""
    path = path.rstrip("/")
    while True:
        yield base + path
        if not path:
            return
        path = path.rsplit("/", 1)[0]


def _cpus(quota: str | None, period: str | None) -> float | None:
    """quota / period in CPUs; None when unlimited ("max", -1) or unread."""
    if quota is None or period is None or quota == "max" or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _v2_limit(folder: str) -> float | None:
    text = _read(f"{folder}/cpu.max")  # "max 100000" or "150000 100000"
    return None if text is None else _cpus(*text.split()[:2])


def _v1_limit(folder: str) -> float | None:
    return _cpus(_read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us"))


def cgroup_cpus(root: str = CGROUP, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """The CPUs the process's cgroups allow (quota / period, the tightest of its cgroup and
    those above it), or None when no quota applies or none can be read."""
    paths = _own_cgroups(proc_cgroup)
    limits = []
    try:
        if "" in paths:  # cgroup v2
            limits += [_v2_limit(folder) for folder in _ancestors(root, paths[""])]
        if "cpu" in paths:  # cgroup v1, the cpu controller's own hierarchy
            base = next(
                (f"{root}/{d}" for d in ("cpu", "cpu,cpuacct") if os.path.isdir(f"{root}/{d}")),
                None,
            )
            if base is not None:
                limits += [_v1_limit(folder) for folder in _ancestors(base, paths["cpu"])]
    except (TypeError, ValueError):  # a file not in the format the kernel writes
        return None
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def default_threads() -> int:
    """One thread per physical core of the affinity set, at most the cgroup quota (rounded
    down: a thread beyond it waits out each period's throttling), at least one."""
    threads = physical_cores(allowed_cpus())
    quota = cgroup_cpus()
    if quota is not None:
        threads = min(threads, math.floor(quota))
    return max(threads, 1)
