"""attestmesh composition root: CLI, settings, metrics registry."""
