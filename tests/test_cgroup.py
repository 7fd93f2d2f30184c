"""A container's memory limit caps what the engine counts as available (pinning, host-memory warnings)."""

import pytest

from h3_core import cgroup, runtime

GIB = 1 << 30


def _group(folder, files: dict, stat: dict):
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name).write_text(f"{value}\n")
    (folder / "memory.stat").write_text("".join(f"{key} {value}\n" for key, value in stat.items()))


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", tmp_path / "sys")
    monkeypatch.setattr(cgroup, "PROC_CGROUP", tmp_path / "self_cgroup")
    return tmp_path


def test_a_v2_limit_less_the_working_set_is_the_room_and_a_parents_tighter_limit_wins(fake_root):
    (fake_root / "self_cgroup").write_text("0::/pod/job\n")
    _group(fake_root / "sys", {"memory.max": "max", "memory.current": 50 * GIB}, {"inactive_file": 0})
    _group(fake_root / "sys/pod/job", {"memory.max": 16 * GIB, "memory.current": 10 * GIB}, {"inactive_file": 2 * GIB})
    assert cgroup.memory_room() == 8 * GIB  # 16 - (10 - 2): inactive file pages can be dropped
    _group(fake_root / "sys/pod", {"memory.max": 12 * GIB, "memory.current": 10 * GIB}, {"inactive_file": 1 * GIB})
    assert cgroup.memory_room() == 3 * GIB


def test_a_v1_limit_counts_and_its_no_limit_value_does_not(fake_root):
    (fake_root / "self_cgroup").write_text("4:memory:/docker/abc\n3:cpu:/docker/abc\n0::/\n")
    unlimited = 9223372036854771712
    _group(fake_root / "sys/memory", {"memory.limit_in_bytes": unlimited, "memory.usage_in_bytes": GIB}, {})
    _group(fake_root / "sys/memory/docker/abc", {"memory.limit_in_bytes": unlimited,
                                                "memory.usage_in_bytes": GIB}, {"total_inactive_file": 0})
    assert cgroup.memory_room() is None
    (fake_root / "sys/memory/docker/abc/memory.limit_in_bytes").write_text(f"{6 * GIB}\n")
    assert cgroup.memory_room() == 5 * GIB


def test_a_container_that_sees_its_own_group_at_the_mount_reads_the_mount(fake_root):
    """Inside a cgroup namespace the path in /proc/self/cgroup may name a group the container cannot see."""
    (fake_root / "self_cgroup").write_text("0::/../host/slice\n")
    _group(fake_root / "sys", {"memory.max": 8 * GIB, "memory.current": 2 * GIB}, {"inactive_file": 0})
    assert cgroup.memory_room() == 6 * GIB


def test_no_cgroup_file_means_no_limit_known(fake_root):
    assert cgroup.memory_room() is None


def test_the_available_memory_and_the_pinnable_bytes_stay_within_the_containers_limit(monkeypatch):
    monkeypatch.setattr(cgroup, "memory_room", lambda: GIB)  # a test machine has more than 1 GiB free
    assert runtime.host_memory_available() == GIB
    assert runtime.pinnable_bytes(None) == 0  # less than the 4 GiB pinning leaves for everything else
