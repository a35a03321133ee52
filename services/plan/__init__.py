"""``gtr-retrieval plan``: capacity from measured benchmark figures and the size profiles.

- :mod:`.measured`: the figures the benches wrote to ``bench/results/*.json``, each with
  where it came from;
- :mod:`.capacity`: the arithmetic (shards, replicas, GPUs, CPU cores, memory), every
  figure with its formula and its sources;
- :mod:`.scaling`: the model-size vs annotated-data trade-off of Fang et al. (SIGIR 2024)
  per encoder size;
- :mod:`.towers`: what a trained encoder architecture costs in Triton (two towers: memory,
  not latency).
  The command is :mod:`services.cli.plan_commands`.
"""
