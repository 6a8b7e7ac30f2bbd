"""tierflow for PyTorch: :mod:`tierflow.torch.optim`. Importing it needs torch
(any version from 2.9); tierflow never links libtorch, tensors cross to its C++
core as DLPack views."""
