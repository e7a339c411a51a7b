"""Tensor parallelism, read in this order: :mod:`.comms` (f, g and the sequence-parallel ḡ, the leaf),
:mod:`.sharded_layers` (column, row, vocab-parallel), :mod:`.sequence` (Megatron SP), :mod:`.model` (the TP
transformer), and :mod:`.nd` (2D/2.5D/3D matmuls)."""
