"""One job's run: the executor and the collaborators it owns.

Each fact of a running job has one store and one mover. The other parts decide and
return the decision (or report what happened) and the mover carries it out, the way
``recovery/decide.py``'s decisions are carried out by the recovery machine:

========== ============================================= ===============================================
fact       stored in -> its one mover                    what the others hand the mover
========== ============================================= ===============================================
state      ``JobExecutor.state`` -> ``_set_state``       ``JobStop`` asks for STOPPING (through the
           (checked against ``state.TRANSITIONS``)       ``set_state`` it is given)
cut        ``JobProgress.cut`` -> the executor: on its   ``JobRecoveryPort.restore_point`` (the cut a
           loop ``progress.begin`` (resume, adopt) and   recovery restored from); ``JobMetrics.stop``
           ``progress.commit`` (a commit heard); what    (a ``NonFiniteStop``'s ``cut``)
           others decided through its ``JobCut``
           (``cut.py``: ``restored``, ``stop``)
commits    etcd (the workers write them) and those       the recovery machine's ``FallBack.drop``
           heard in ``JobProgress`` -> the executor's    (through ``JobRecoveryPort.drop_commit``); a
           ``JobCut.drop_commit`` (etcd through          ``NonFiniteStop``'s ``drop``
           ``JobTerm.drop_commit``, and the progress)
grants     ``Grants`` (``grants.py``, held as            a ``Hold`` from a ``Drain`` (through
           ``JobProgress.grants``: window, holds, halt,  ``JobDrains.hold``) or from ``JobStop.check``;
           refusals) -> the executor: ``widen``,         the ``NonFinite`` ``JobMetrics.check`` returns;
           ``hold``, ``halt``, ``refused``/``retry``.    a refused grant (``grant_failed``).
           ``Grants.now`` says what each worker gets     ``JobWorkers.grant`` only sends what
           now                                           ``Grants.now`` said
log floor  ``JobProgress.log_floor`` -> the executor's   a ``LogFloor`` in ``JobDrains.step``'s
           ``JobCut`` (``floors``, ``reset_logs``); the  ``DrainsStep`` (a drain's move); a restart of
           progress trims it as the cut passes it        every runtime (``JobRecoveryPort.reset_all``)
           (``commit``, ``restored``)
placement  ``JobPlacement.slices`` and its device        the recovery machine returns the places it
           leases -> ``JobPlacement`` (``place``,        leased to ``JobRecoveryPort.place``;
           ``apply``, ``release_on``, ``release_all``)   ``JobDrains.move``/``park`` call it directly
recovery   ``RecoveryRecord`` in ``JobRecoveries``       ``JobPlacement.remap`` returns the seconds it
records    -> each recovery's ``Recovery`` machine       waited for spares, the port the runtimes'
           (phases, plan, restore, the wait for spares,  generations; ``JobRecoveries`` opens the record
           the generations)                              and notes first calls
skips      ``JobRollbacks.skips`` (``rollback.py``) ->    a ``RollBack`` raised by ``JobEvents`` (a spike
           ``JobRollbacks.roll_back``, which hands them  ``JobRollbacks.observe`` judged, or a value not
           to the loads and the job record; a resume or  finite under ``on_nonfinite = "rollback"``);
           adoption reads them back (``adopt``)          ``rollback_plan`` (``recovery/spikes.py``)
========== ============================================= ===============================================

A rollback (``rollback.py``) is the executor's too: it moves the cut, the commits, the grants and
the log floor of the whole job at once (``JobProgress.rewind``, ``JobCut.drop_commit``).

``tests/orchestrator/test_one_mover.py`` scans the source for the rows cut, commits, grants
and log floor: no module but the store touches their fields, and no module but the
executor (its loop, ``events.py``, ``losses.py`` and ``rollback.py``, and its ``JobCut``) calls their movers.
The placement still has the callers the last column names.
"""
