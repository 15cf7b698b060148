"""Operating-system errors of any `rallypoint` verb: one line naming the path and what to do, exit 1."""

from __future__ import annotations

import errno
from pathlib import Path

from click.testing import CliRunner

from rallypoint.client.commands.main import main, os_error_message


def invoke(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, list(args))
    assert not isinstance(r.exception, OSError), f"{args}: an OSError escaped: {r.exception!r}"
    return r.exit_code, r.output


def test_certs_to_a_folder_it_cannot_make_names_the_path_and_writes_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out = invoke("certs", "--out", str(blocker / "certs"))
    assert code == 1
    assert f"error: cannot use {blocker / 'certs'}: Not a directory" in out
    assert "give another path" in out and "Traceback" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_up_with_a_state_dir_it_cannot_make_names_the_path_and_starts_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out = invoke("up", "--state-dir", str(blocker / "state"))
    assert code == 1 and f"cannot use {blocker / 'state'}" in out and "Traceback" not in out


def test_a_tls_dir_whose_files_cannot_be_read_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").mkdir()  # a folder where the CA's certificate should be
    for name in ("client.crt", "client.key"):
        (tmp_path / name).write_text("x")
    code, out = invoke("workers", "--cluster", "a@127.0.0.1:9", "--tls-dir", str(tmp_path))
    assert code == 1 and "Traceback" not in out
    assert str(tmp_path / "ca.crt") in out or "ca.crt" in out, out


def test_the_message_says_what_to_do_for_each_kind_of_error() -> None:
    for code, hint in ((errno.EACCES, "permissions"), (errno.ENOENT, "does not exist"),
                       (errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only")):
        msg = os_error_message(OSError(code, "why", "/some/path"))
        assert msg.startswith("cannot use /some/path: why;") and hint in msg, msg
    assert "/some/path" not in os_error_message(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))


def test_delete_run_refuses_a_name_that_is_not_a_run_id_before_reaching_the_cluster(tmp_path: Path) -> None:
    code, out = invoke("delete-run", "--state-dir", str(tmp_path / "none"), "job", "../../etc")
    assert code == 1 and "'../../etc' is not a run id" in out and not (tmp_path / "none").exists()


def test_run_new_run_is_for_a_cluster_not_the_reference() -> None:
    job = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
    code, out = invoke("run", "--reference", "--new-run", "--steps", "1", str(job))
    assert code == 1 and "--new-run" in out and "takes no" in out
