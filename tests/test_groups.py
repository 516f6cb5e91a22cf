"""Workers hold every process group they create (the gloo teardown deadlock workaround)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HOLDS = textwrap.dedent("""
    import sys
    from rove.agent import groups
    assert groups.hold()
    assert "torch.distributed.distributed_c10d" not in sys.modules, "nothing imported yet"
    import torch.distributed as dist
    store = dist.FileStore(sys.argv[1], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sub = dist.new_group(backend="gloo")
    held = list(groups.HELD)
    assert len(held) == 2 and held[1] is sub, held
    dist.destroy_process_group(sub)
    del sub
    import gc; gc.collect()
    assert groups.HELD[1] is held[1], "a destroyed group is still held"
    dist.destroy_process_group()
    print("HELD", len(groups.HELD))
""")


@pytest.mark.parametrize("setting", ["", "0"])
def test_every_process_group_a_worker_creates_is_held_unless_switched_off(
    tmp_path: Path, setting: str
) -> None:
    """Also checks that this torch still has the private function the hold wraps: a
    torch without it would print the warning (and this test would fail)."""
    script = (
        HOLDS
        if not setting
        else HOLDS.replace("assert groups.hold()", "assert not groups.hold()").replace(
            "held = list(groups.HELD)\n",
            "held = list(groups.HELD)\nassert held == []; print('HELD 0'); sys.exit(0)\n",
        )
    )
    env = {"ROVE_HOLD_PROCESS_GROUPS": setting} if setting else {}

    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("HELD 0" if setting else "HELD 2")
    assert "process groups are not held" not in out.stderr
