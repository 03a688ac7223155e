"""The model core: the packed batch (packing), the model contract, attention and its kernels, the layers families
share, and the chunked loss head. Imports nothing else of zoo but zoo.errors."""
