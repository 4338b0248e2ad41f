"""pacmpi.experiments: the lab beside the product.

The training job behind ``pacmpi train``, the ``pacmpi bench train|masks|bias`` drivers, the
compression baselines PacTrain is compared with (TopK, TernGrad, DGC), offline datasets and
small models. It imports the core, the adapters and ``pacmpi.launch``; nothing in the product
imports it.
"""
__all__ = ["train", "bench_train", "bench_masks", "bench_bias", "baselines", "data", "models"]
