"""NeuroFlux (Saikumar & Varghese, EuroSys 2024): local learning under a memory budget, in dataflow order.

- ``models``: VGG-11/16/19 and ResNet-18 for 32x32 inputs as flat lists of layers;
- ``aux``: the auxiliary classifier each layer learns against (adaptive or classic widths);
- ``profiler``: training memory of each layer + head at a few batch sizes, fitted to a line;
- ``partition``: Algorithm 1, layers -> blocks, each with the largest batch that fits the budget;
- ``local``: block-wise local learning (each layer steps on its own loss) with a resumable state;
- ``spill``: a trained block's outputs written to the store and read back, re-chunked, prefetched;
- ``blocks``: the loop over blocks: stored blocks reused, spills written, read and dropped;
- ``exit``: choosing the early exit and exporting the compact model with ``torch.export``;
- ``stage``: the recipe stages ``neuroflux`` (and its ``classic_ll`` variant) and ``backprop``.
"""
