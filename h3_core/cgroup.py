"""How much more memory a container's limit lets this process take (Linux control groups, v1 and v2).

MemAvailable counts the whole machine's memory; inside a container with a memory limit the kernel stops the
process well before that runs out, and pinned memory counts against the limit too.
"""

from __future__ import annotations

from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit file, usage file, memory.stat's reclaimable file pages) for each version
V2_FILES = ("memory.max", "memory.current", "inactive_file")
V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def memory_room() -> int | None:
    """The least room (limit less working set: usage less inactive file pages, as the kubelet counts) over this
    process's memory cgroup and its ancestors; None where no limit is set or none can be read."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            rooms += _rooms(CGROUP_ROOT, path, V2_FILES)
        elif "memory" in controllers.split(","):
            rooms += _rooms(CGROUP_ROOT / "memory", path, V1_FILES)
    return min(rooms) if rooms else None


def _rooms(mount: Path, path: str, files: tuple[str, str, str]) -> list[int]:
    """Each limited group's room from the process's group up to the mount (a container sees its own group at the
    mount, with its path from the host's view: then only the mount is read)."""
    group = mount / path.strip("/")
    if not group.is_dir():
        group = mount
    rooms = []
    while True:
        room = _room(group, *files)
        if room is not None:
            rooms.append(room)
        if group == mount or mount not in group.parents:
            return rooms
        group = group.parent


def _room(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (group / limit_file).read_text().strip()
        if limit_text == "max":
            return None
        limit, usage = int(limit_text), int((group / usage_file).read_text())
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
    except (OSError, ValueError):
        return None
    if limit >= 1 << 60:  # v1's "no limit" is the largest page-aligned 64-bit number
        return None
    return max(0, limit - usage + int(stat.get(inactive_key, 0)))
