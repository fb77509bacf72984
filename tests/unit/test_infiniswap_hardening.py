"""``infiniswap.hardening.capability_hint``: what a refused capability asks the user to do.

"Run as root" is right only for a process that is not root. A root process that lacks the
capability (in a container, or after its launcher dropped it) is told which set it is
missing from. The uid and the capability masks are injected; the last test checks the hint
this very process gets."""
from __future__ import annotations

import os

import pytest

from infiniswap.hardening import CAP_IPC_LOCK, CAP_SYS_RESOURCE, capability_hint

ALL = (1 << 41) - 1
WITHOUT = ALL & ~(1 << CAP_SYS_RESOURCE)


def hint(**kw) -> str:
    return capability_hint("CAP_SYS_RESOURCE", CAP_SYS_RESOURCE, **kw)


def test_a_process_that_is_not_root_is_told_to_run_as_root():
    text = hint(euid=1000, effective=0, bounding=ALL)
    assert text == "needs CAP_SYS_RESOURCE (run as root)"


def test_root_without_it_in_the_bounding_set_is_told_so_not_to_run_as_root():
    text = hint(euid=0, effective=WITHOUT, bounding=WITHOUT)
    assert "CAP_SYS_RESOURCE" in text and "bounding set" in text and "container" in text
    assert "--cap-add SYS_RESOURCE" in text
    assert "run as root" not in text


def test_root_with_it_bounded_but_not_effective_is_told_the_effective_set_lacks_it():
    text = hint(euid=0, effective=WITHOUT, bounding=ALL)
    assert "effective capability set" in text and "run as root" not in text


def test_a_process_that_has_it_is_told_a_policy_refused_it():
    for euid in (0, 1000):
        text = hint(euid=euid, effective=ALL, bounding=ALL)
        assert "which this process has" in text and "run as root" not in text


def test_the_capability_number_is_the_one_checked():
    text = capability_hint("CAP_IPC_LOCK", CAP_IPC_LOCK, euid=0, effective=WITHOUT, bounding=WITHOUT)
    assert "which this process has" in text            # WITHOUT lacks only CAP_SYS_RESOURCE


def test_this_process_gets_the_hint_its_own_capabilities_call_for():
    with open("/proc/self/status") as fh:
        caps = {k: int(v, 16) for k, _, v in (ln.partition(":") for ln in fh) if k in ("CapEff", "CapBnd")}
    text = hint()
    if caps["CapEff"] >> CAP_SYS_RESOURCE & 1:
        assert "which this process has" in text
    elif os.geteuid() != 0:
        assert text.endswith("(run as root)")
    elif not caps["CapBnd"] >> CAP_SYS_RESOURCE & 1:
        assert "bounding set" in text                   # e.g. this development container
    else:
        assert "effective capability set" in text


@pytest.mark.parametrize("euid", [0, 1000])
def test_unreadable_masks_fall_back_to_the_uid(monkeypatch, euid):
    import infiniswap.hardening as h
    monkeypatch.setattr(h, "_capability_sets", lambda: (None, None))
    text = hint(euid=euid)
    assert ("run as root" in text) == (euid != 0)
