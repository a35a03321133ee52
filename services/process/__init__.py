"""What a process of the service sets up on its host, below any RPC.

``logs``
    logging, configured once by an entry point, never at import.
``redis_client``
    Redis clients (one URL names a single Redis or a Redis Cluster), the transient
    errors retried, the URL file read.
``cpus``
    CPU sets: parse a ``taskset``-style list, pin a process thread by thread.
``priority``
    a process's scheduling weight against other sessions (its autogroup's nice): a
    rollout's processes yield the CPUs to serving, and Triton encoding only documents
    waits behind the searches' work.
``private``
    files for their owner only (the local stack's umask; what other commands add to its
    run directory is tightened to match).
``ports``
    ports for a local server to listen on, free and below the kernel's ephemeral range
    (never an outgoing connection's local port).
``hold``
    a rollout's processes paused while the gateway has a search in flight: the list
    ``up`` writes, the gateway's pause (``--hold-file``) and its bound.
``loop_watch``
    a late event loop seen and named: a heartbeat, and a thread that logs the loop
    thread's stack when it is late (``--loop-watch-ms``).
"""
