"""A gang member's bounds (workers/gang/member_bounds.py): its job's folder, values and copies only."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from rallypoint.proto import rallypoint_pb2 as pb
import numpy as np

from rallypoint.workers.gang.member_bounds import check_request, host_arguments


def transfer(job: str) -> str:
    return base64.b64encode(pb.TransferHeader(job=job).SerializeToString()).decode()


def test_a_bound_member_refuses_paths_outside_its_jobs_folder_and_another_jobs_values(tmp_path: Path) -> None:
    job_dir = tmp_path / "root" / "j"
    (job_dir / "run1").mkdir(parents=True)
    (job_dir / "run1" / "out").symlink_to(tmp_path)  # a link leading out of the folder
    dirs = [str(job_dir)]
    for ok in ({"op": "save", "dir": str(job_dir / "run1" / "s" / "tmp")}, {"op": "restore", "dir": str(job_dir)},
               {"op": "send", "transfer": transfer("j")}, {"op": "stash", "job": "j"}, {"op": "call"},
               {"op": "saved", "dir": "/anywhere"}):
        check_request(ok, job="j", dirs=dirs)
    for bad, why in (({"op": "save", "dir": "/etc/x"}, "under the job's folder"),
                     ({"op": "restore", "dir": str(job_dir / ".." / "k")}, "under the job's folder"),
                     ({"op": "restore", "dir": str(job_dir / "run1" / "out" / "elsewhere")}, "under the job's folder"),
                     ({"op": "save", "dir": str(tmp_path / "root" / "j2")}, "under the job's folder"),
                     ({"op": "send", "transfer": transfer("k")}, "job 'k'"),
                     ({"op": "restore_parts", "job": "k"}, "job 'k'"), ({"op": "stash"}, "refused")):
        with pytest.raises(ValueError, match=why):
            check_request(bad, job="j", dirs=dirs)
    with pytest.raises(ValueError, match="keeps no checkpoints"):  # a job without a run directory saves nothing
        check_request({"op": "save", "dir": str(job_dir)}, job="j", dirs=[])
    check_request({"op": "save", "dir": "/anywhere"}, job="", dirs=[])  # unbound: a group formed in one process


def test_a_member_starts_only_for_the_job_and_slice_its_workers_leases_name() -> None:
    import json

    from rallypoint.etcd.cluster_records import Holder
    from rallypoint.etcd.keys import Keys
    from rallypoint.workers.gang.link import MemberRefused
    from rallypoint.workers.gang.member_bounds import leased_dirs
    from tests.fakes import MemoryStore

    store, keys = MemoryStore(), Keys("c")
    store.put(keys.lease("w1", 0), Holder(job="j", slice="s", nonce="n", term=3).to_json())
    store.put(keys.lease("w1", 1), Holder(job="other", slice="s", nonce="n", term=3).to_json())
    store.put(keys.job("j"), json.dumps({"job": "j", "run_dir": "/ckpt/j/r1"}))
    assert leased_dirs(store, keys, "w1", "j", "s", [0]) == ["/ckpt/j"]
    for job, slice_name, devices, why in (("j", "s", [0, 1], "held by job 'other'"), ("j", "t", [0], "slice 's'"),
                                          ("j", "s", [2], "leased to nobody"), ("", "s", [0], "must name its job"),
                                          ("j", "s", [], "must name its job")):
        with pytest.raises(MemberRefused, match=why):
            leased_dirs(store, keys, "w1", job, slice_name, devices)


def test_a_calls_small_host_arguments_are_read_as_declared_and_a_mismatch_is_refused() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = host_arguments([{"arg": 1, "dtype": "<f4", "shape": [2, 3]}, {"arg": 0, "dtype": "<i4", "shape": []}],
                         [x.tobytes(), np.int32(7).tobytes()], 3)
    assert np.array_equal(got[1], x) and int(got[0]) == 7 and got[0].shape == ()
    arg = {"arg": 0, "dtype": "<f4", "shape": [2, 3]}
    for given, payloads, why in (([arg], [], "declares 1 host arguments and carries 0"),
                                 ([arg], [x.tobytes()[:-1]], "23 bytes do not hold a float32 array of shape"),
                                 ([{**arg, "arg": 3}], [x.tobytes()], "host argument 3 refused"),
                                 ([arg, arg], [x.tobytes()] * 2, "host argument 0 refused"),
                                 ([{**arg, "dtype": "|O"}], [x.tobytes()], "do not hold an? object")):
        with pytest.raises(ValueError, match=why):
            host_arguments(given, payloads, 3)
