"""One job's run: the executor and the collaborators it owns.

Each fact of a running job has one store and one mover. The other parts decide and
return the decision (or report what happened) and the mover carries it out, the way
``recovery/decide.py``'s decisions are carried out by the recovery machine:

========== ============================================= ===============================================
fact       stored in -> its one mover                    what the others hand the mover
========== ============================================= ===============================================
state      ``JobExecutor.state`` -> ``_set_state``       ``JobStop`` asks for STOPPING (through the
           (checked against ``state.TRANSITIONS``)       ``set_state`` it is given)
cut        ``JobProgress.cut`` -> the executor:          ``JobRecoveryPort.restore_point`` (the cut a
           ``progress.begin`` (resume, adopt),           recovery restored from); ``JobMetrics.stop``
           ``progress.commit`` (a commit heard),         (a ``NonFiniteStop``'s ``cut``)
           ``progress.restored``
commits    etcd (the workers write them) and those       the recovery machine's ``FallBack.drop``
           heard in ``JobProgress`` -> the executor's    (through ``JobRecoveryPort.drop_commit``); a
           ``_drop_commit`` (``JobTerm.drop_commit``     ``NonFiniteStop``'s ``drop``
           in etcd, and the progress)
grants     ``Grants`` (``grants.py``, held as            a ``Hold`` from a ``Drain`` (through
           ``JobProgress.grants``: window, holds, halt,  ``JobDrains.hold``) or from ``JobStop.check``;
           refusals) -> the executor: ``widen``,         the ``NonFinite`` ``JobMetrics.check`` returns;
           ``hold``, ``halt``, ``refused``/``retry``.    a refused grant (``grant_failed``).
           ``Grants.to_send`` says what each worker      ``JobWorkers.grant`` only sends what
           gets now                                      ``to_send`` said
log floor  ``JobProgress.log_floor`` -> the executor:    a ``LogFloor`` in ``JobDrains.step``'s
           ``progress.floor``, ``progress.reset_floor``; ``DrainsStep`` (a drain's move); a restart of
           the progress trims it as the cut passes it    every runtime, reported by
           (``commit``, ``restored``)                    ``JobRecoveryPort.reset_all`` (``reset_logs``)
placement  ``JobPlacement.slices`` and its device        the recovery machine returns the places it
           leases -> ``JobPlacement`` (``place``,        leased to ``JobRecoveryPort.place``;
           ``apply``, ``release_on``, ``release_all``)   ``JobDrains.move``/``park`` call it directly
recovery   ``RecoveryRecord`` in ``JobRecoveries``       ``JobRecoveries`` opens it and notes first
records    -> each recovery's ``Recovery`` machine       calls, ``JobPlacement.remap`` adds the wait for
           (phases, plan, restore)                       spares, ``executor._restored`` the generations
                                                         (writers still, not decisions)
========== ============================================= ===============================================

``tests/orchestrator/test_one_mover.py`` scans the source for the rows cut, commits, grants
and log floor: no module but the store touches their fields, and no module but the
executor calls their movers. The placement and the recovery records still have the
callers the last column names.
"""
