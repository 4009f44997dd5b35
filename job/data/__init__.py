"""Input: the one dispatch by ``data.source`` (``source``) over the sources (``imagefolder``, ``synthetic``,
``shards``, ``usersource``), what image sources share (``images``), the loaders (``loaders``), the resumable
sampler (``sampler``), the loader worker processes (``workers``), host-to-device prefetch (``prefetch``) and
generated datasets (``datagen``)."""
