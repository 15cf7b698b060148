"""Following a chaos scenario's job: its events, through leader losses and the scenario's suspends, to its end.

:class:`ScenarioFollower` submits the job and follows it with the client's
:class:`~rallypoint.client.submission.JobFollower`: after a leader loss the new leader adopts the
job by itself and the follower finds it there (``WatchJob``; nobody resumes it). When the
scenario suspends the job as an operator would (``kind = "suspend"``), it records what the
cluster holds then, resumes it after ``resume_after_s`` (``ResumeJob``) and follows it on. On
the way it keeps what the job's events say: the steps done (what the fault scheduler waits
for), the recoveries, drains and straggler decisions, where each slice runs (the injectors'
:class:`~rallypoint.chaos.injectors.Target`), and the job's outcome and final states.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from rallypoint.basics.errors import RallypointError, StoreError
from rallypoint.chaos.injectors import Injectors, Target
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Store
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb

FOLLOW_S = 120.0  # after a leader loss, how long the harness looks for the job on the new leader


class ScenarioFollower:
    """What the harness follows of the scenario's job (see the module doc).

    Args:
        lc: the scenario's cluster.
        target: what the injectors aim at; the job's events keep its placement and gang members.
        injectors: the scenario's injectors (a straggler whose fault healed before its
            migration ended is uncordoned through them).
        done: set when the run ends (the job's end, or the watchdog's verdict: :meth:`time_out`).
        say: where the harness's progress events go.
    """

    def __init__(self, lc: LocalCluster, target: Target, injectors: Injectors, *, done: threading.Event,
                 say: Callable[[dict[str, Any]], None]) -> None:
        self.lc, self.target, self.injectors, self.done, self.say = lc, target, injectors, done, say
        self.completed = 0
        self.recoveries: dict[tuple[int, float], dict[str, Any]] = {}
        self.drains: list[dict[str, Any]] = []
        self.stragglers: list[dict[str, Any]] = []  # job.straggler events: each decision with its evidence
        self.resumes: list[dict[str, Any]] = []
        # The scenario's suspends, each with its resume (the summary's ``suspends``), in the order asked
        self.suspends: list[dict[str, Any]] = []
        self._suspends_lock = threading.Lock()
        self.outcome: dict[str, Any] = {"state": "failed", "reason": "not run"}
        self.detail: dict[str, Any] = {}
        self.final_states: dict[str, list[Any]] | None = None  # the states the job ended with, when it finished
        self._follower: Any = None  # the client's JobFollower now following the job
        self._last_event = time.monotonic()

    def on_event(self, ev: pb.JobEvent) -> None:
        """One event of the job: what it says of the job's progress, placement and recoveries."""
        self._last_event = time.monotonic()
        detail = json.loads(ev.detail or "{}")
        if ev.event in ("job.placed", "job.recovered", "job.drained", "job.watching"):
            where = detail.get("placement", detail)
            self.target.placement.update({s: p["worker"] for s, p in where.items()
                                          if isinstance(p, dict) and "worker" in p})
            self.target.members.update({s: [m["worker"] for m in p["members"]] for s, p in where.items()
                                        if isinstance(p, dict) and p.get("members")})
        if ev.event == "step.done":
            self.completed = max(self.completed, int(ev.step) + 1)
        elif ev.event == "job.recovered":
            self.recoveries[(detail["recovery"], detail["detected_at"])] = detail
            self.say({"event": "chaos.recovered", "recovery": detail["recovery"], "lost": detail["lost"],
                      "checkpoint_step": detail["checkpoint_step"]})
        elif ev.event == "job.drained":
            self.drains.append(detail)
            self.say({"event": "chaos.drained", "worker": detail["worker"], "moved": detail["moved"],
                      "step": int(ev.step), "paused_s": detail["paused_s"]})
        elif ev.event == "job.straggler":
            self.stragglers.append(detail)
            self.say({"event": "chaos.straggler", **{k: v for k, v in detail.items() if k != "evidence"}})
            w = detail["worker"]
            if detail["decision"] == "migrated" and w in self.injectors.straggled - self.injectors.straggling:
                detail["uncordoned"] = self.injectors.uncordon_straggler(w)  # its fault healed before the move ended
        elif ev.event in ("job.resumed", "job.adopted", "job.watching"):
            self.completed = max(self.completed, int(ev.step))
            if ev.event == "job.resumed":
                with self._suspends_lock:
                    for sp in self.suspends:
                        if sp.get("resumed_at") is not None and sp.get("resumed_from") is None:
                            sp["resumed_from"] = int(detail.get("checkpoint_step", ev.step))
        if ev.event in ("job.handed_off", "job.adopted"):
            self.say({"event": f"chaos.{ev.event.split('.')[1]}", "step": int(ev.step), **detail})

    def follow(self, spec: pb.JobSpec) -> None:
        """Submit, then follow the job to its end through leader losses (and the scenario's suspends).

        No operator steps in after a leader loss: a new leader adopts the job by itself and the
        client follows it there (``WatchJob``, :class:`~rallypoint.client.submission.JobFollower`).
        ``self.resumes`` (the summary's ``resumes``) stays empty: nothing resumes a lost job.
        A job that ends SUSPENDED by the scenario's own suspend (``kind = "suspend"``) is resumed
        after that suspend's ``resume_after_s`` (``ResumeJob``, as
        :func:`~rallypoint.client.submission.resume` calls it, followed by the same follower, so that the
        final event still carries the final states) and followed on; ``self.suspends`` keeps each.
        """
        from rallypoint.client.submission import JobError, JobFollower

        lc = self.lc
        call: Callable[[Any], Any] = lambda stub: stub.SubmitJob(spec)
        while True:
            follower = JobFollower(spec.job, lc.endpoints, lc.keys.cluster, on_event=self.on_event,
                                   follow_s=FOLLOW_S, open_wait_s=60)
            self._follower = follower
            if self.done.is_set():  # the watchdog ended the run while the job was suspended
                return
            try:
                ev = follower.follow(call)
            except (JobError, RallypointError) as exc:
                if not self.done.is_set():  # the watchdog's verdict (timed out) stands when it cancelled
                    self.outcome = {"state": "failed", "reason": str(exc)}
                return
            finally:
                for sw in follower.switches:
                    self.say({"event": "chaos.leader_switch", "why": sw["why"], "from": sw["from"]})
            if ev.event != "job.suspended" or not self._suspended(spec.job, ev):
                break
            call = lambda stub: stub.ResumeJob(pb.ResumeRequest(job=spec.job))
        if ev.event == "job.suspended" and self.done.is_set():  # timed out while suspended: the watchdog's verdict
            return
        self.detail = json.loads(ev.detail or "{}")
        self.final_states = {v.state: [codec.from_tensor(t) for t in v.leaves] for v in ev.states}
        state = "finished" if ev.event == "job.finished" else "failed"
        self.outcome = {"state": state, "reason": self.detail.get("reason", "")}

    def time_out(self, reason: str) -> None:
        """The watchdog's verdict: the run failed with ``reason`` and ends; the follower in progress gives up."""
        self.outcome = {"state": "failed", "reason": reason}
        self.done.set()
        follower = self._follower
        if follower is not None:
            follower.cancel(reason)

    def expect_suspend(self, sp: dict[str, Any]) -> None:
        """Keep the record of a suspend the scenario is about to ask (before it is asked: the job may end
        suspended before the injector returns)."""
        with self._suspends_lock:
            self.suspends.append(sp)

    def _suspended(self, job: str, ev: pb.JobEvent) -> bool:
        """The job ended SUSPENDED: when one of the scenario's suspends asked it, record what the cluster
        holds now (the job's record, its device leases: none may be left), wait that suspend's
        ``resume_after_s`` and return True (resume it); False: nobody here asked (the job's end)."""
        detail = json.loads(ev.detail or "{}")
        with self._suspends_lock:
            sp = next((x for x in self.suspends if x.get("suspended_at") is None and not x.get("error")), None)
            stop = detail.get("stop") or {}  # the harness's own suspend: its reason (the record's `by` is the
            if sp is None or not str(stop.get("reason", "")).startswith("chaos harness"):  # caller's certificate)
                return False
            sp.update(suspended_at=time.time(), step=int(ev.step), cut=detail.get("cut"),
                      reason=detail.get("reason", ""))
        store = self.lc.store()
        try:
            record = store.get(self.lc.keys.job(job))
            sp["record_state"] = record.json().get("state") if record is not None else None
            sp["record_cut"] = record.json().get("cut") if record is not None else None
            sp["leases_held"] = leases_of(store, self.lc.keys, job)
        except StoreError as exc:  # the suspend-resume check fails on it; the job is still resumed
            sp.update(record_state=f"unread (etcd: {exc})", leases_held=["unread"])
        finally:
            store.close()
        self.say({"event": "chaos.suspended", "step": sp["step"], "cut": sp["cut"], "record": sp["record_state"],
                  "leases_held": len(sp["leases_held"]), "resume_after_s": sp["resume_after_s"]})
        if self.done.wait(sp["resume_after_s"]):
            return False
        sp["resumed_at"] = time.time()
        self.say({"event": "chaos.resume", "job": job})
        return True


def leases_of(store: Store, keys: Keys, job: str) -> list[str]:
    """The device leases ``job`` holds now (their keys)."""
    from rallypoint.etcd.cluster_records import Holder

    kvs, _ = store.get_prefix(keys.leases)
    out: list[str] = []
    for kv in kvs:
        try:
            if Holder.from_json(kv.value).job == job:
                out.append(kv.key)
        except (ValueError, KeyError, TypeError):
            out.append(kv.key)  # an unreadable lease is reported, not ignored
    return sorted(out)
