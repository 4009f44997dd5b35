"""Checkpoints: durable atomic saves with verified manifests (``store``), host snapshots for async saves
(``snapshot``), what a checkpoint holds (``states``) and how a run picks one up (``resume``)."""
