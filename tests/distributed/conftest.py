"""The spawned-rank helpers live in ddp_workers.py (importable by the forked ranks)."""
