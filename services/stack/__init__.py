"""``gtr-retrieval up``: the whole system on this machine, as supervised child processes.

Package map:

- ``launcher``: ``up`` itself: starts the children in order, ingests, stops.
- ``config``: what ``up`` starts and where it keeps its files.
- ``children``: child processes: start, wait until healthy, supervise, stop.
- ``forking``: the fork server shard processes are forked from (their libraries
  imported once).
- ``components``: each component's argv, environment and readiness (Redis, shards,
  rerank, gateway), the run's TLS files and tokens.
- ``triton_component``: Triton: the ONNX export, the repository, ports, TLS, readiness.
- ``prometheus_component``: Prometheus (when installed) and its targets file.
- ``certs``: the run's throwaway CA and certificates.
- ``endpoints``: where a running stack listens, and how a client reaches it.
- ``first_run``: the first ``up`` on a run directory (encode, train, store).
- ``generations``: the stack's side of index generations and rollouts (the shards of
  every running generation, a rollout's CPU budget).
"""
