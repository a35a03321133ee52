"""The index shard itself, no grpc.

Package map:

- ``shard``: one shard in memory (``IvfPqShard``): apply changes, search, report.
- ``scan``: the FAISS calls of a search beyond ``index.search`` (preassigned scan, refine).
- ``tags``: the metadata tags' postings a filtered search selects by; the filter check.
- ``pq_drift``: the PQ error of recent adds against training (the retrain signal).
- ``slots``: FAISS id → storage slot, for a whole batch at once.
- ``snapshots``: durable snapshot files, and the shard's state codec they hold.
- ``transfer``: a snapshot (and trained index) sent to a peer in checksummed chunks.
- ``text``: the BM25 text index (Tantivy) beside the vectors.
- ``gpu``: the optional GPU copy of a shard's IVF-PQ (re-attached after an error).
- ``gpu_stale``: the copy's stale entries dropped or re-scored in one vectorised pass.
- ``coarse``: the coarse quantizer every shard shares (assign once, probe everywhere).
- ``query``: a search as one shard sees it, and its answer grid.
- ``changes``: the changes a shard applies, as they come out of its log.
- ``ids``: which shard a document lives on, and its 63-bit FAISS id.
- ``rwlock``: the readers-writer lock of searches and applies.
- ``stats``: what a shard replica reports about itself.
- ``train``: training the coarse quantizer, PQ codebooks and refine codec.
- ``trained``: the trained, empty index every shard starts from.
"""
