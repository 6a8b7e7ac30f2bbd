"""tierflow for PyTorch: :mod:`tierflow.torch.optim` (which steps FSDP2's
DTensor shards too) and :mod:`tierflow.torch.fsdp` (FSDP2's gradient clipping
for shards in host memory). Importing it needs torch
(any version from 2.9); tierflow never links libtorch, tensors cross to its C++
core as DLPack views."""
