"""Context parallelism: :mod:`.ring_attention` (K/V round a ring, zigzag load balance) and
:mod:`.ulysses` (all-to-all between sequence and head sharding)."""
