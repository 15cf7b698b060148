"""A killed worker's scratch folders (unpacked code, host sources' TMPDIR) are swept by the next worker on the host;
a live process's are not. Real processes, a real SIGKILL, real folders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rallypoint.workers.scratch import scratch_dir, sweep_orphans

NS = os.stat("/proc/self/ns/pid").st_ino  # this process's pid namespace, as the folders' names carry it
MAKES = ("import sys, time\n"
         "from pathlib import Path\n"
         "from rallypoint.workers.scratch import scratch_dir\n"
         "code, source = scratch_dir('code'), scratch_dir('source')\n"
         "(Path(code) / 'bundle').mkdir(); (Path(code) / 'bundle' / 'job.py').write_text('x = 1')\n"
         "(Path(code) / 'bundle' / 'job.py').chmod(0o444); (Path(code) / 'bundle').chmod(0o555)\n"
         "print(code); print(source, flush=True)\n"
         "time.sleep(120)\n")


@pytest.mark.processes
def test_a_killed_processs_scratch_folders_are_swept_and_a_live_ones_are_kept(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-c", MAKES], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        made = [Path(p.stdout.readline().strip()) for _ in range(2)]
        assert [d.parent for d in made] == [tmp_path] * 2 and all(d.is_dir() for d in made), made
        assert all(f"-{NS}.{p.pid}-" in d.name for d in made)
        assert sweep_orphans(tmp_path) == []  # its process lives: nothing is touched
        assert all(d.is_dir() for d in made)
    finally:
        p.send_signal(signal.SIGKILL)  # as a lost host's worker: it removes nothing
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()
    mine = Path(tempfile.mkdtemp(prefix=f"rallypoint-code-{NS}.{os.getpid()}-", dir=tmp_path))  # this process: alive
    other = tmp_path / "rallypoint-checkpoints-1-x"  # not a scratch folder's name
    other.mkdir()
    # The dead process's pid, in another pid namespace (a container sharing the folder): a pid this process cannot
    # see, which may well be alive there.
    elsewhere = tmp_path / f"rallypoint-source-{NS + 1}.{p.pid}-abcdefgh"
    elsewhere.mkdir()
    assert sorted(sweep_orphans(tmp_path)) == sorted(made)
    assert not any(d.exists() for d in made)
    assert mine.is_dir() and other.is_dir() and elsewhere.is_dir()


def test_a_scratch_folder_names_its_kind_and_an_unknown_kind_is_refused(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    d = Path(scratch_dir("source"))
    assert d.parent == tmp_path and d.name.startswith(f"rallypoint-source-{NS}.{os.getpid()}-")
    with pytest.raises(ValueError, match="'cache' is not one of"):
        scratch_dir("cache")
