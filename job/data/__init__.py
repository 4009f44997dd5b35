"""Input: generated datasets (``datagen``), the resumable sampler (``sampler``), loaders and transforms
(``loaders``), the loader worker processes (``workers``) and host-to-device prefetch (``prefetch``)."""
