"""Chunk/page selection shared by every sparse path: the per-chunk key summaries the tiers store,
the page scores of sparse decode and the chunk scores of a pruned re-prefill are one set of
functions (:mod:`.pages`), so a summary written to disk scores the same way as one kept in memory."""
