"""A pod's hosts file is replaced whole (tests/support/k8s_sim.py ``write_hosts``): a lookup reads the old file or
the new one, never an empty or a half-written one, whenever the simulation rewrites it."""

from __future__ import annotations

import threading
from pathlib import Path

from support import k8s_sim as ks

REWRITES = 300


def _version(i: int) -> list[str]:
    """Version ``i`` of a hosts file: 64 lines, larger than one page, so an in-place write is many steps."""
    return ["127.0.0.1 localhost", *(f"10.232.{i % 256}.{j} pod-{i}-{j} pod-{i}-{j}.default.svc" for j in range(64))]


def _text(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def _pod(tmp_path: Path) -> ks.Pod:
    """A pod whose (empty) hosts file exists, as its network makes it."""
    (tmp_path / "hosts").write_text("")
    return ks.Pod("pod", "Master", 0, "netns", 0, hosts=tmp_path / "hosts")


def test_a_lookup_that_opened_the_file_reads_one_version_whole(tmp_path: Path) -> None:
    pod = _pod(tmp_path)
    ks.write_hosts(pod, _version(0))
    with open(pod.hosts, "rb", buffering=0) as lookup:  # type: ignore[arg-type]
        head = lookup.read(40)  # a lookup reads a file in pieces (unbuffered here: each piece from the file)
        ks.write_hosts(pod, _version(1))  # the simulation publishes a change mid-read
        rest = lookup.read()
    assert (head + rest).decode() == _text(_version(0))
    assert pod.hosts.read_text() == _text(_version(1))  # type: ignore[union-attr]
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]  # no temporary file left behind


def test_concurrent_lookups_never_see_an_empty_or_partial_file(tmp_path: Path) -> None:
    pod = _pod(tmp_path)
    ks.write_hosts(pod, _version(0))
    versions = {_text(_version(i)) for i in range(REWRITES + 1)}
    reading, done = threading.Event(), threading.Event()
    seen: list[str] = []
    bad: list[str] = []

    def lookups() -> None:
        while not done.is_set():  # bounded: the writer sets it after its last rewrite
            text = pod.hosts.read_text()  # type: ignore[union-attr]
            seen.append(text)
            if text not in versions:
                bad.append(text)
            reading.set()

    reader = threading.Thread(target=lookups)
    reader.start()
    reading.wait()  # the rewrites start once lookups run: they overlap whatever the machine's speed
    try:
        for i in range(1, REWRITES + 1):
            ks.write_hosts(pod, _version(i))
    finally:
        done.set()
        reader.join()
    assert not bad, f"{len(bad)} of {len(seen)} reads saw a torn file, e.g. {bad[0][:200]!r}"
