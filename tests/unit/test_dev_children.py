"""`kvstore.dev.children`: the demo signals only a node process the local dev cluster recorded as
its own child (same node id and address, and the very process: a reused pid is refused), never a
pid a node reports. Real processes started by the test stand in for the nodes."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import NodeInfo
from kvstore.dev import children
from kvstore.dev.children import Child


def node(node_id: str = "node-1", address: str = "127.0.0.1:50051") -> NodeInfo:
    return NodeInfo(node_id, address, (0,), True)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child process standing in for a store node (reaped by the test, so its pid stays ours)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_choose_matches_id_and_address() -> None:
    recorded = [Child("node-1", "127.0.0.1:50051", 11, "1", "c"), Child("node-2", "127.0.0.1:50052", 12, "1", "c")]
    assert children.choose(recorded, node("node-2", "127.0.0.1:50052")) == recorded[1]
    why = children.choose(recorded, node("node-2", "10.0.0.9:50052"))  # same id, another cluster's address
    assert isinstance(why, str) and "not one of its nodes" in why and "node-1 at 127.0.0.1:50051" in why
    assert children.choose([], node()) == "the dev cluster recorded no nodes"


def test_same_process_needs_the_recorded_identity() -> None:
    child = Child("node-1", "a:1", 11, "123", "python -m kvstore.server")
    assert children.same_process(child, ("123", "python -m kvstore.server"))
    assert not children.same_process(child, ("124", "python -m kvstore.server"))  # the pid was reused
    assert not children.same_process(child, ("123", "something else"))
    assert not children.same_process(child, None)  # no such process


def test_process_identity_of_a_live_and_a_gone_process(sleeper: subprocess.Popen[bytes]) -> None:
    identity = children.process_identity(sleeper.pid)
    assert identity is not None and "time.sleep(60)" in identity[1]
    assert children.process_identity(sleeper.pid) == identity  # stable while it runs
    assert children.process_identity(os.getpid()) != identity
    sleeper.kill()
    sleeper.wait(10)
    assert children.process_identity(sleeper.pid) is None
    assert children.child_of("node-1", "127.0.0.1:50051", sleeper.pid) is None  # gone: nothing to record


def test_record_and_load_round_trip(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    assert children.load(tmp_path) == []
    child = children.child_of("node-1", "127.0.0.1:50051", sleeper.pid)
    assert child is not None and child.pid == sleeper.pid
    children.record(tmp_path, [child])
    assert children.load(tmp_path) == [child]
    assert not list(tmp_path.glob("*.tmp"))
    children.forget(tmp_path)
    assert children.load(tmp_path) == []
    (tmp_path / children.CHILDREN_FILE).write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable"):
        children.load(tmp_path)


def test_kill_signals_only_the_recorded_child(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    child = children.child_of("node-1", "127.0.0.1:50051", sleeper.pid)
    assert child is not None
    children.record(tmp_path, [child])
    kill = children.dev_cluster_kill(tmp_path)
    assert kill(node(), 0) == f"pid {sleeper.pid}"  # signal 0: may we? (nothing delivered)
    assert sleeper.poll() is None
    with pytest.raises(RuntimeError, match="not one of its nodes"):
        kill(node("node-2", "127.0.0.1:50052"), signal.SIGKILL)
    assert sleeper.poll() is None
    kill(node(), signal.SIGKILL)
    assert sleeper.wait(10) == -signal.SIGKILL


def test_kill_refuses_a_pid_that_is_not_the_recorded_process(tmp_path: Path,
                                                               sleeper: subprocess.Popen[bytes]) -> None:
    """The record says pid P started at another time: P is some other process now. Refused."""
    child = children.child_of("node-1", "127.0.0.1:50051", sleeper.pid)
    assert child is not None
    children.record(tmp_path, [dataclasses.replace(child, started=child.started + "0")])
    with pytest.raises(RuntimeError, match="gone or the pid now belongs to another process"):
        children.dev_cluster_kill(tmp_path)(node(), signal.SIGKILL)
    assert sleeper.poll() is None


def test_kill_without_a_dev_cluster_refuses_and_says_how(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        children.dev_cluster_kill(tmp_path / "nowhere")(node(), signal.SIGKILL)
    message = str(info.value)
    assert "only a node the local dev cluster started" in message and "--data-dir" in message


def test_a_child_is_recorded_once_its_command_line_shows() -> None:
    """Right after Popen the kernel may still show an empty command line (the new program's
    argument bounds are set a little after execve switched memory). Recording that made the demo
    refuse a live node as "gone" (CI, twice): the record waits for the line, within a bound."""
    reads = iter([("4242", ""), ("4242", ""), ("4242", "python -m kvstore.server")])
    child = children.child_of("node-1", "127.0.0.1:50051", 7, identity_of=lambda pid: next(reads))
    assert child is not None and child.command == "python -m kvstore.server" and child.started == "4242"
    # A process that never shows one is recorded as it is, once the bound has passed.
    empty = children.child_of("node-1", "127.0.0.1:50051", 7, settle_s=0.02, identity_of=lambda pid: ("1", ""))
    assert empty is not None and empty.command == ""
    # Gone meanwhile: nothing to record.
    assert children.child_of("node-1", "127.0.0.1:50051", 7, identity_of=lambda pid: None) is None


def test_a_child_just_started_is_recorded_with_its_command_line() -> None:
    for _ in range(20):  # the race is narrow: try it a few times with real processes
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
        try:
            child = children.child_of("node-1", "127.0.0.1:50051", proc.pid)
            assert child is not None and "time.sleep(5)" in child.command, child
        finally:
            proc.kill()
            proc.wait()
