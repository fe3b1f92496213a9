"""The Apptainer/Singularity backend (backend.py): `apptainer exec` in a user namespace and root the
daemon makes, from a sandbox directory or the root partition of a SIF file (sif_mount.py)."""
