"""Index generations: rollout, rollback, retire, drift-watch, the CPU budget and which encoder
versions stay published (issues #24, #32; the design: docs/generations.md).

Layering: ``generations`` sits above ``index``, ``encoder`` and ``common`` (it imports
them) and below ``gateway``, ``stack`` and ``cli`` (they import it; it never imports them).
The record's format lives one layer down, in :mod:`services.index.records` (a shard reads
its own record) with :class:`services.common.encoder_spec.EncoderSpec`.

Package map (module → role):

- :mod:`.registry`       the registry in Redis: generations, states, the alias switch, the
                         rollout lock, the writer gates; :func:`~.registry.shards_run`
- :mod:`.state`          :class:`~.state.RolloutState`, the rollout's one typed record, and
                         :class:`~.state.RolloutStore`, its only reader and writer
- :mod:`.context`        options, plan, wiring and the context every phase works with
- :mod:`.builder`        :class:`~.builder.RolloutBuilder`: start, resume, abort, rollback;
                         runs the phases in order, the heartbeat
- :mod:`.phase_publish`  phases ``publish`` (a new encoder), ``create`` and ``p0``
- :mod:`.phase_train`    phase ``train`` (sample, train the target's quantizer)
- :mod:`.retrain`        a retrain's sample: the source replicas' vectors
- :mod:`.gpu_serving`    what a new generation keeps of the source's GPU search (its
                         pq_m, GPU settings) and why a rollout losing it is refused
- :mod:`.phase_bulk`     phase ``bulk``: the SCAN re-embedded and appended
- :mod:`.phase_catch_up` phase ``catch_up`` and the log replay the switch shares
- :mod:`.held`           the source log entries a rollout holds (the lag) and their bound
- :mod:`.phase_switch`   phase ``switch``: gates, last replay, alias, rollback hold
- :mod:`.target_replicas` whether T's replicas serve and applied T's logs (their Stats)
- :mod:`.rollback`       rollback's start and the abort of a rollout
- :mod:`.operations`     what ``index rollout | rollback | retire | generations`` decide:
                         the plan from options, start or resume, when the CPU budget
                         starts around a publish, an abort's outcome, displaced
                         generations, retire's choice, the status rows
- :mod:`.lifecycle`      retire, and the generations' sizes for ``index generations``
- :mod:`.encoders`       which encoder versions stay published (retire's release,
                         ``encoder unpublish``'s question)
- :mod:`.append`         the idempotent append into a target generation's logs
- :mod:`.encoding`       re-embedding: the encoder's text cut, batching, retries
- :mod:`.pacing`         the re-embedding paced on the searches' p99 (pauses between calls)
- :mod:`.serving_latency` the searches' latency the gateways report, and its reading
- :mod:`.documents`      the SCAN of a layout's documents
- :mod:`.logs`           log tails, counts, trims and holds
- :mod:`.replicas`       the shard replicas' Stats (applied positions, sizes, drift)
- :mod:`.progress`       the progress bar and metrics of ``index rollout``
- :mod:`.drift`          the drift watcher (a rollout when the quantizer drifted): its
                         loop, ``--once`` reading and SIGTERM handling
- :mod:`.standby`        a generation's shard waits until its generation is ready
- :mod:`.tokens`         what a write token of another epoch means for the serving
                         generation (the rule the gateway applies to SESSION searches)
- :mod:`.budget`         a rollout's CPU budget, the builder's side (the Redis key, TTL)
- :mod:`.placement`      the CPU budget's decisions: which process on which CPUs, the
                         hand-over, the active budget
- :mod:`.stack_placed`   the builder's waits on the local stack's placement record:
                         held before each budgeted phase, handed over in the switch
- :mod:`.errors`         domain errors a caller words its own way (the CLI adds flags:
                         a refused plan names its option, ``PlanRefused.option``)

What stays outside: ``services/stack/generations.py`` supervises the generations' shard
processes (it asks :func:`~.registry.shards_run` and :mod:`.placement` for every decision);
``services/gateway/generations.py`` is the gateway's alias cache and per-generation client
bundles (gRPC machinery; its tokens resolved by :mod:`.tokens`); the CLI only registers
commands, turns flags into calls and words results and errors
(``services/cli/generation_commands.py`` the flags, ``generation_handlers.py`` the words,
``generation_places.py`` the connections and the flags named in errors;
``drift_commands.py``); ``services/encoder/serve/publish.py`` and ``unpublish.py`` publish
and unpublish versions in a Triton repository (``versions.py`` its lock and staging,
``triton_load.py`` the loads).
"""
